"""Launching: ``ddpkit run`` on the launcher side, and the entry point every worker runs.

- ``launcher``: preflight checks once, torchrun's argv, signal forwarding, exit codes.
- ``forked``: CPU workers forked from a launcher that imported torch once (``--start-method fork``).
- ``torchrun_adapter``: what the launcher needs from torchrun beyond its command line (its parser, its failure records), in one place.
- ``entrypoint``: the worker side; argv read once, failures turned into clear exit codes.
- ``worker_scope``: what a worker holds for one ``fit()``: process group, hang watchdog, goodput ledger.
"""
