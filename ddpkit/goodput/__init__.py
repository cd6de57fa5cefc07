"""Goodput: where a run's wall time went, written as it happens and read afterwards.

- ``ledger``: :class:`GoodputLedger`, each attempt appends its moments (start, resume, first
  step, checkpoints, end) to ``<output_dir>/goodput.jsonl``.
- ``reading``: reads that file into a partition of the wall time by category (``ddpkit goodput``).
- ``faults``: what each fault cost, split from the last step before it to the first step after it (the
  launcher's agent writes one line per failed attempt).
- ``plot``: draws it (``ddpkit plot --goodput``; needs matplotlib).
"""
