"""Checkpoints: crash-safe files, and the run's state that they hold.

- ``files``: write (temp file, fsync, rename, manifest last), validate, find the newest good one,
  load safely (``weights_only=True``).
- ``state``: the run's state, one owner: what a checkpoint holds and which one a run resumes from.
"""
