"""Everything a run tells the user: logs, the console, metrics files, timelines, trackers.

- ``reporter``: the one object the loop reports to; ``log``: rank-aware logging.
- ``console``: rank 0's progress display (a live bar on a terminal, lines in a batch log).
- ``sink_base``: the :class:`Sink` interface (``ddpkit.Sink``); ``sinks``: where metrics go (JSON lines,
  TensorBoard, run status); ``trackers``: MLflow, W&B.
- ``timeline``: a Chrome-trace timeline, one row per rank.
"""
