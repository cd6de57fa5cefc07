"""Launching: ``ddpkit run`` on the launcher side, and the entry point every worker runs.

- ``launcher``: preflight checks once, torchrun's argv, signal forwarding, exit codes.
- ``entrypoint``: the worker side; argv read once, failures turned into clear exit codes.
"""
