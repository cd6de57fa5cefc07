"""Commands that read finished runs: ``ddpkit runs`` (a table of runs) and ``ddpkit plot``; and
``ddpkit estimate`` (bytes per rank of each ``parallel.mode``, before a run)."""
