"""Checkpoints: crash-safe files, and the run's state that they hold.

- ``files``: write (temp file, fsync, rename, manifest last), validate, find the newest good one,
  load safely (``weights_only=True``).
- ``staging``: ``checkpoint.async``'s host copy of the state: reused buffers, pinned for CUDA tensors, filled
  by queued copies that the background writer waits for, so the loop pays little more than queuing them.
- ``run_lock``: one writer per run directory: global rank 0 holds ``.ddpkit.lock`` (host, pid, start time,
  refreshed); a second run on a live run's directory is refused, a dead run's lock is taken over.
- ``disk_space``: room for a save: a warning before one that will not fit, one line naming the checkpoint,
  the space needed and free and the newest complete checkpoint when a write fails.
- ``components``: the one state protocol: every part that must survive a restart is registered by
  name (``state_dict`` / ``load_state_dict``); a checkpoint's schema is the list of those names.
- ``checkpointer``: the one owner of the run's checkpointed parts: whether a save is due, writing it
  (two collectives in ddp mode), resuming, waiting; ``metadata``: the fields every kind of save writes;
  ``resume``: which checkpoint a run resumes from, and whether it may.
- ``best``: ``best.pt`` when ``checkpoint.best.metric`` improves; ``final_outputs``: the run's final weights by
  ``checkpoint.model_pt``'s rule: ``model_export``'s ``model.pt``, and for a split model ``hf_output``'s Hugging
  Face directory, each rank writing what it holds.
- ``interval``: ``checkpoint.every_steps: auto``, the Young/Daly interval from measured save and step times.
- ``sharded`` / ``sharded_run``: ``parallel.mode`` zero1 / fsdp2: a DCP directory per checkpoint,
  every rank writing its shard, committed by rename; any checkpoint resumes into any mode and world size.
- ``crash_save`` / ``boundary_rng``: a crashed worker costs zero steps: the lowest surviving rank
  saves the last completed step, with every rank's RNG state read from small shared-memory slots.
- ``memory_tier``: snapshots of the state in ``/dev/shm`` every K steps, for a host that loses every worker.
- ``preemption``: stop on a signal after the same optimizer step on every rank, save it, exit 75
  (the one owner of "stopped").
"""

# What the Trainer composes, importable from the package.
from ddpkit.checkpoint.best import BestCheckpoint
from ddpkit.checkpoint.checkpointer import Checkpointer
from ddpkit.checkpoint.components import Stateful
from ddpkit.checkpoint.final_outputs import save_final_model
from ddpkit.checkpoint.model_export import save_model

__all__ = ["BestCheckpoint", "Checkpointer", "Stateful", "save_final_model", "save_model"]
