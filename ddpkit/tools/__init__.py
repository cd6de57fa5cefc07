"""Commands that read finished runs: ``ddpkit runs`` (a table of runs) and ``ddpkit plot``."""
