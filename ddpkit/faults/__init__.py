"""When things go wrong: hangs, preemption, failed ranks.

- ``watchdog`` / ``watchdog_io``: a heartbeat per rank through the job's store; stops a hung job.
- ``hang_monitor`` / ``hang_report``: decide that a job hangs, gather every rank's stacks, write
  the report that names the stuck rank first.
- ``preemption``: stop on a signal after the same optimizer step on every rank, then save.
"""
