"""The hang watchdog: a thread per rank that notices a job making no progress, names the stuck
rank with every rank's stacks, and stops the job within ``dist.hang_timeout`` seconds.

- ``heartbeat``: :class:`Watchdog`, the per-rank thread: heartbeats through the job's own store
  (no collectives), the phase each rank is in, stopping the job.
- ``monitor``: the judge: decides that a job hangs, gathers every rank's stacks, writes the report.
- ``report``: what the report says: which ranks are stuck, which wait for them, every thread's stack.
- ``backstop``: a rank frozen in C code holding the GIL: faulthandler's dump of its stacks and its step, in a file.
- ``store_io``: store calls with a deadline, torchrun's error file, exiting from a thread.
"""
