"""Launching: ``ddpkit run`` on the launcher side, and the entry point every worker runs.

- ``launcher``: preflight checks once, torchrun's argv, signal forwarding, exit codes.
- ``forked``: CPU workers forked from a launcher that imported torch once (``--worker-start fork``).
- ``warm_imports``: the libraries a user's script imports at its top, imported once in the launcher before forking.
- ``one_node_rendezvous``: a one-node job's rendezvous, each round complete at once (``ddpkit-loopback``).
- ``torchrun_adapter``: what the launcher needs from torchrun beyond its command line (its parser, its failure
  records, its polling), in one place.
- ``entrypoint``: the worker side; argv read once, failures turned into clear exit codes.
- ``worker_scope``: what a worker holds for one ``fit()``: process group, hang watchdog, goodput ledger.
- ``run_parts``: the parts the worker's loop works with (reporter, checkpointer, health, the update, the model
  views, the step object, validation), built in their one order for the Trainer.
"""
