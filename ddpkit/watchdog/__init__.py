"""The hang watchdog: a thread per rank that notices a job making no progress, names the stuck
rank with its stacks, and stops the job within ``dist.hang_timeout`` seconds.

- ``heartbeat``: :class:`Watchdog`, the per-rank thread: the phase each rank is in, its beat, stopping the job.
- ``node_board``: one node's beats in shared memory: each rank a slot, no store call.
- ``node``: the rank that leads a node reads its node-mates' slots and speaks for them in the store.
- ``monitor``: the judge: decides that a job hangs, gathers the suspects' stacks, writes the report.
- ``report``: what the report says: which ranks are stuck, which wait for them, every thread's stack.
- ``backstop``: a rank frozen in C code holding the GIL: faulthandler's dump of its stacks and its step, in a file.
- ``failure``: after a failed ``fit()``, waiting until the other ranks have read the failure.
- ``store_io``: store calls with a deadline, torchrun's error file, exiting from a thread.
"""
