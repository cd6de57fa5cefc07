"""Everything a run tells the user: logs, the console, metrics files, timelines, trackers.

- ``events``: the loop's one ordered list of listeners (spans, steps, logs, failure, exit).
- ``reporter``: the one object the loop reports to; ``log``: rank-aware logging; ``running_mean``:
  the training loss, reduced across ranks only when logged.
- ``console``: rank 0's progress display (a live bar on a terminal, lines in a batch log).
- ``sink_base``: the :class:`Sink` interface (``ddpkit.Sink``); ``sinks``: where metrics go (JSON lines,
  TensorBoard, run status); ``trackers``: MLflow, W&B.
- ``throughput``: ``tokens_per_s`` and ``mfu`` for runs that train on tokens; ``stage_time``: under a pipeline,
  each stage's busy seconds and idle share in the schedule.
- ``timeline``: a Chrome-trace timeline, one row per rank; ``profiler``: ``train.profile``'s torch.profiler traces.
"""

# What the Trainer composes, importable from the package.
from ddpkit.reporting.events import Events
from ddpkit.reporting.profiler import Profiler
from ddpkit.reporting.reporter import Reporter, start_logging
from ddpkit.reporting.throughput import TokenThroughput

__all__ = ["Events", "Profiler", "Reporter", "TokenThroughput", "start_logging"]
