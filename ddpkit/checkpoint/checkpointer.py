"""The checkpointer: one owner of what a checkpoint holds, when a save is due, and how it is written and resumed.

    checkpointer = Checkpointer(config, runtime=runtime, progress=progress, stop=stop, pauses=reporter)
    checkpointer.register(builtin={"model": model, "optimizer": optimizer, ...}, user=trainer.checkpoint_parts())
    resumed = checkpointer.resume()          # once, after everything is built: restore, or seed a fresh run
    ...
    checkpointer.save(step)                  # after every optimizer step and every epoch: saves when due
    checkpointer.save(step, name="best")     # a named save, whatever the schedule
    checkpointer.save(step, last=True)       # the end of the run: when checkpointing is on or a signal stopped it
    checkpointer.wait()                      # background writes on disk; rank 0's failure raised on every rank

As torchtitan's ``CheckpointManager``: the loop says where it is, the checkpointer decides whether a
save is due (``checkpoint.every_steps`` / ``every_epochs`` / ``auto``, or an agreed stop on a signal,
:mod:`ddpkit.checkpoint.preemption`), and what a checkpoint holds is decided by registration alone
(:mod:`ddpkit.checkpoint.components`): each part's ``state_dict()``, every rank's RNG streams and the
run's metadata (:mod:`ddpkit.checkpoint.metadata`). The file is a plain dict, so
``torch.load(weights_only=True)`` reads it and ``ddpkit export`` takes ``["model"]`` out.

A periodic save in ``ddp`` mode costs two collectives, wherever it is written from:

1. one all-gather: every rank's RNG streams and its verdict on its parameters being finite (no
   non-finite checkpoint is ever written, and every rank refuses together);
2. one broadcast: rank 0's outcome after it wrote (or staged, under ``checkpoint.async``), with the
   failure of its previous background write if that failed, and its timing for ``every_steps: auto``.
   The broadcast is also the barrier: no rank goes on before rank 0's write is decided, and a write
   that fails on rank 0 (a full disk, a quota) stops every rank with the same one line.

Sharded modes (zero1, fsdp2) write every rank's shards through DCP (:mod:`ddpkit.checkpoint.sharded_run`).
The crash save and memory snapshots (:meth:`protections`) capture through :meth:`capture`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol

from ddpkit.checkpoint import files as ckpt
from ddpkit.checkpoint.components import METADATA_KEYS, Components, Ledger, Stateful, read_checkpoint
from ddpkit.checkpoint.crash_save import CrashSave
from ddpkit.checkpoint.interval import AutoInterval
from ddpkit.checkpoint.memory_tier import MemorySnapshots
from ddpkit.checkpoint.metadata import manifest_fields, run_metadata
from ddpkit.checkpoint.preemption import StopOnSignal
from ddpkit.checkpoint.resume import check_compatible, choose_checkpoint, note_allowed_position, with_sample_position
from ddpkit.checkpoint.sharded import is_sharded_checkpoint
from ddpkit.checkpoint.sharded_run import (
    TENSOR_PARTS,
    ShardedOptimizer,
    ShardedRun,
    full_capture,
    read_any,
    restore_components,
)
from ddpkit.checkpoint.storage import RemoteMirror
from ddpkit.config.schema import Config
from ddpkit.config.split import Split
from ddpkit.distributed.collectives import all_gather_object, broadcast_object
from ddpkit.distributed.process_group import Runtime
from ddpkit.errors import CheckpointError, ConfigError, HealthError
from ddpkit.parallel.layout import ParallelLayout, data_parallel_for
from ddpkit.progress import Progress
from ddpkit.reporting.log import log
from ddpkit.training.replicas import require_finite
from ddpkit.training.rng import capture_rng, rank_seed, seed_everything

__all__ = ["Checkpointer", "Pauses"]


class Pauses(Protocol):
    """Where a save's time goes: left out of samples/s (:meth:`ddpkit.reporting.reporter.Reporter.outside_training`)."""

    def outside_training(self, name: str) -> AbstractContextManager[None]: ...


class Checkpointer:
    """Owns the run's checkpointed parts: when to save, writing, resuming, waiting (see the module docstring)."""

    def __init__(
        self,
        config: Config,
        *,
        runtime: Runtime,
        progress: Progress,
        stop: StopOnSignal,
        pauses: Pauses,
        layout: ParallelLayout | None = None,
    ):
        self.config = config
        self.runtime = runtime
        self.progress = progress
        #: How the state is spread: DCP directories when it is sharded or cut into pipeline stages.
        self.layout = layout or ParallelLayout.without_mesh(data_parallel_for(config.parallel), runtime.env)
        self.rank = runtime.env.rank
        self.world_size = runtime.env.world_size
        ck = config.checkpoint
        self.components = Components()
        self.user_parts: tuple[str, ...] = ()
        self.optimizer_order: list[str] | None = None
        self._stop = stop
        self._pauses = pauses
        self._writer = ckpt.AsyncCheckpointWriter() if ck.async_save else None
        # zero1 / fsdp2 / pipelines: DCP
        self._sharded = ShardedRun.for_layout(self.layout, config, self.components, rank=self.rank)
        self._periodic = bool(ck.every_steps or ck.every_epochs or ck.best)
        # Young/Daly's interval, from the measured cost of a save.
        self._auto = AutoInterval(ck.mtbf_hours) if ck.every_steps == "auto" else None
        self._last_saved_step = -1
        # checkpoint.dir is a URL (docs/storage.md); else None
        self.mirror = RemoteMirror.for_run(config, runtime, sharded=self._sharded is not None)

    # --- what a checkpoint holds --------------------------------------------------------------

    def register(
        self,
        *,
        builtin: Mapping[str, Stateful | None],
        user: Mapping[str, Stateful] | None = None,
        optimizer_order: list[str] | None = None,
    ) -> None:
        """Every part a checkpoint holds, by name, in one call (None: nothing to save, e.g. no scheduler).

        ``user``: a subclass's own parts (:meth:`ddpkit.Trainer.checkpoint_parts`), refused when a name is
        one of ddpkit's. Register before :meth:`resume` to be restored by it. ``optimizer_order``: where the
        registered model is a part of the whole one (a pipeline's stages), the whole model's parameter names in its
        optimizer's order, by which a single-file checkpoint's optimizer state is keyed.
        """
        self.optimizer_order = optimizer_order
        user = dict(user or {})
        reserved = {**{key: "metadata" for key in METADATA_KEYS}, **{n: type(p).__name__ for n, p in builtin.items()}}
        for name, part in user.items():
            if name in reserved:
                raise ConfigError(
                    f"Trainer.checkpoint_parts() returned a part named {name!r}, which is ddpkit's own part {name!r} "
                    f"({reserved[name]}); rename yours (e.g. 'my_{name}'). ddpkit's parts: {', '.join(reserved)}"
                )
            if not callable(getattr(part, "state_dict", None)) or not callable(getattr(part, "load_state_dict", None)):
                raise ConfigError(
                    f"Trainer.checkpoint_parts() part {name!r} is a {type(part).__name__}, which has no "
                    "state_dict() / load_state_dict(): give it both (any torch module or optimizer has them)"
                )
        for name, part in {**builtin, **user}.items():
            if self._sharded is not None and name == "optimizer" and part is not None:
                # zero1 / fsdp2: never captured by one rank alone.
                part = ShardedOptimizer(part)
            self.components.register(name, part)
        self.user_parts = tuple(user)

    def capture(self, exclude: tuple[str, ...] = (), *, rng: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """Every registered part's state and the run's metadata, less ``exclude``: what a checkpoint holds.

        A collective (the ``rng`` part gathers every rank's streams), unless ``rng`` gives those streams
        (the periodic save gathers them with its finite check; the crash save reads them from files).
        """
        metadata = run_metadata(self.config, world_size=self.world_size)
        if rng is not None:
            state = self.components.capture(metadata=metadata, exclude=(*exclude, "rng"))
            return {**state, "rng": rng, "schema": [*state["schema"], "rng"]}
        if self._sharded is None or exclude:
            return self.components.capture(metadata=metadata, exclude=exclude)
        # A whole single-file state of a sharded run (memory snapshots): gathered on rank 0, a collective.
        small = self.components.capture(metadata=metadata, exclude=TENSOR_PARTS)
        return full_capture(small, self.components, rank=self.rank)

    def protections(self, *, ledger: Ledger) -> list[CrashSave | MemorySnapshots | None]:
        """The listeners that protect this state between checkpoints (after resume): the crash save of the
        last completed step, and memory snapshots every K steps. (The store's :attr:`mirror` is a listener of
        its own, added as soon as the checkpointer exists: its on_exit uploads model.pt and frees the lock.)"""
        config = self.config
        runtime = self.runtime
        layout = self.layout
        if layout.pp > 1 or layout.tp > 1:
            held = "one stage" if layout.pp > 1 else f"1/{layout.tp} of each block"
            log.info(
                "the crash save and memory snapshots are off under %s: a lone survivor holds %s, not the model; "
                "a restart resumes from the newest checkpoint (checkpoint.every_steps)",
                "a pipeline" if layout.pp > 1 else "tensor parallelism",
                held,
            )
            return []
        crash_save = CrashSave.arm(config, runtime, self, ledger=ledger)
        return [crash_save, MemorySnapshots.arm(config, runtime, self, ledger=ledger)]

    # --- resume -------------------------------------------------------------------------------

    def resume(self) -> bool:
        """Restore the checkpoint ``checkpoint.resume`` names, or seed a fresh run; True if resumed.

        A fresh run reseeds every rank differently (independent dropout and augmentation; under a pipeline each
        stage's ranks from a seed of their own, :func:`ddpkit.training.rng.rank_seed`); a resumed
        one restores each rank's RNG streams exactly where they were. A user part the checkpoint lacks
        (it was written before the part existed) keeps its state as built, with a warning naming it.
        """
        if self.mirror is not None and self.config.checkpoint.resume == "auto":
            # An empty disk: the store's newest valid checkpoint.
            self.mirror.fetch(self.config.checkpoint_dir)
        chosen = choose_checkpoint(self.config, rank=self.rank)
        if chosen is None:
            # seed + rank; under a pipeline, each stage seeded apart; a replica's tensor ranks alike (rank_seed)
            layout = self.layout
            where = {"stage": layout.pp_rank, "stages": layout.pp, "tensor": layout.tp}
            seed = rank_seed(self.config.run.seed, rank=self.rank, world_size=self.world_size, **where)
            seed_everything(seed)
            return False
        path, state = chosen
        if self.mirror is not None:
            # Never deleted from the store while this run goes on.
            self.mirror.protect(path)
        allowed = check_compatible(state, path, self.config, world_size=self.world_size, components=self.components)
        # The epoch's position in samples, whatever split wrote it: this run's split finds its batch from it.
        state = with_sample_position(state)
        # any format into any layout
        restore_components(
            path,
            state,
            self.components,
            mode=self.layout.data_parallel.name,
            spread=self._sharded is not None,
            order=self.optimizer_order,
        )
        self._last_saved_step = self.progress.step
        for name in self.user_parts:
            if state.get(name) is None:
                log.warning(
                    "resuming from %s, which holds no part %r (Trainer.checkpoint_parts): it starts as built",
                    path,
                    name,
                )
        log.info("resuming from %s (step %d)", path, self.progress.step)
        note_allowed_position(allowed, self.progress, Split.of_config(self.config, world_size=self.world_size))
        return True

    def rollback(self, names: tuple[str, ...] = ("model", "optimizer", "scheduler", "scaler")) -> bool:
        """Load ``names`` from the newest valid checkpoint (every rank; progress, data and RNG go on); False if none.

        ``health.spike.action=rollback``: the weights and optimizer go back, the run continues past the
        batches that spiked instead of meeting them again. A single file or a sharded (DCP) checkpoint, in this
        run's layout or another: the model and optimizer load as a resume loads them, every rank its own part.
        """
        if self._sharded is not None:
            # An async save still in flight is committed first, so the newest checkpoint is what it wrote
            self._sharded.wait()
        info = ckpt.find_latest_checkpoint(self.config.checkpoint_dir) if self.rank == 0 else None
        path = broadcast_object(str(info.path) if info is not None else None)
        if path is None:
            return False
        state = read_checkpoint(read_any(path), path=path)
        spread = self._sharded is not None or is_sharded_checkpoint(path)
        small = tuple(name for name in names if not spread or name not in TENSOR_PARTS)
        loaded = self.components.load(state, small)
        if spread and any(name in TENSOR_PARTS for name in names):
            # A collective: each rank reads its own shards (DCP), or its part of a single file
            ShardedRun.restore(path, state, self.components, order=self.optimizer_order)
            loaded = [name for name in names if name in TENSOR_PARTS] + loaded
        log.info("rolled back %s to %s", ", ".join(loaded), path)
        return True

    # --- save ---------------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        """Whether the run ends with a checkpoint: when checkpointing is configured, or a signal stopped it."""
        return self._periodic or self._stop.stopped

    def save(self, step: int, *, last: bool = False, name: str | None = None) -> bool:
        """Save step ``step`` if it is due (every rank calls it, after each step and each epoch); True if saved.

        ``name`` (e.g. "best"): save now under that name, never pruned. ``last``: the run's end, saved when
        :attr:`enabled`. A step already saved is not saved again.
        """
        if name is None and not self._due(step, last=last):
            return False
        with self._pauses.outside_training("checkpoint"):
            started = time.perf_counter()
            if self._sharded is not None:
                # A collective: every rank checks its own parameters, all raise together.
                require_finite(self.components["model"], what=f"the checkpoint of step {step}")
                keep = self.config.checkpoint.keep_last
                self._sharded.save(self.capture, self.config.checkpoint_dir, step=step, name=name, keep_last=keep)
                self._uploaded(step, name, suffix=".dcp")
                # Rank 0's measurement decides, for every rank.
                blocked = time.perf_counter() - started
                measured = broadcast_object(self._auto.measurement(blocked)) if self._auto else None
            else:
                measured = self._save_file(step, name, started)
        if name is None:
            self._last_saved_step = step
            if self._auto is not None:
                self._auto.adopt(measured, since=step)
        return True

    def _due(self, step: int, *, last: bool) -> bool:
        """The schedule's verdict for a call after step ``step`` (an epoch's end: ``batch_in_epoch`` is 0 again)."""
        if step == self._last_saved_step:
            return False
        if last:
            return self.enabled
        ck = self.config.checkpoint
        # After an epoch: progress.epoch already counts it.
        if self.progress.batch_in_epoch == 0:
            return bool(ck.every_epochs) and self.progress.epoch % ck.every_epochs == 0
        if self._auto is not None:
            # One clock read: the step times `auto` converts seconds with.
            self._auto.tick()
        # An attribute read until a signal arrives.
        if self._stop.requested and self._stop.stop_here(step):
            # Every rank agreed to stop after this step: save it whatever the schedule says.
            return True
        if self._auto is not None:
            return self._auto.due(step - max(0, self._last_saved_step))
        return bool(ck.every_steps) and step % ck.every_steps == 0

    def _save_file(self, step: int, name: str | None, started: float) -> tuple[float, float] | None:
        """ddp: one all-gather (RNG streams, finite verdicts), rank 0 writes, one broadcast of its outcome."""
        streams_and_verdicts = all_gather_object((capture_rng(), _nonfinite(self.components["model"], step)))
        verdicts = [verdict for _, verdict in streams_and_verdicts if verdict is not None]
        if verdicts:
            # Every rank, together: nothing written, nothing pruned.
            raise HealthError(verdicts[0])
        state = self.capture(rng=[streams for streams, _ in streams_and_verdicts])
        failure = measured = None
        if self.rank == 0:
            ck = self.config.checkpoint
            kwargs = dict(
                step=step, name=name, keep_last=ck.keep_last, meta=manifest_fields(state, epoch=self.progress.epoch)
            )
            try:
                if self._writer is not None:
                    # Waits for the previous write: its failure is reported here.
                    self._writer.stage_and_submit(state, self.config.checkpoint_dir, **kwargs)
                else:
                    ckpt.save_checkpoint(state, self.config.checkpoint_dir, **kwargs)
                # Queued: an async write is waited for by the upload.
                self._uploaded(step, name, suffix=".pt")
            except CheckpointError as exc:
                # A full disk, a quota: every rank must hear it (below).
                failure = str(exc)
            measured = self._auto.measurement(time.perf_counter() - started) if self._auto else None
        failure, measured = broadcast_object((failure, measured))
        _raise_everywhere(failure, rank=self.rank)
        return measured

    def log_fields(self) -> dict[str, float]:
        """The store's upload figures for the training record (``checkpoint.dir`` a URL; rank 0's), else none."""
        return self.mirror.metrics() if self.mirror is not None else {}

    def _uploaded(self, step: int, name: str | None, *, suffix: str) -> None:
        """Queue the store's copy of the save just made (``checkpoint.dir`` a URL); returns at once."""
        if self.mirror is not None:
            self.mirror.saved(
                ckpt.checkpoint_path(self.config.checkpoint_dir, step=step, name=name, suffix=suffix), step=step
            )

    def wait(self) -> None:
        """Block until background saves are on disk (a failed one stops every rank); then, if a signal stopped the
        run, every rank says so (before the run's last barrier: once one rank exits, torchrun ends the others)."""
        if self._writer is not None:
            failure = None
            if self.rank == 0:
                try:
                    self._writer.wait()
                except CheckpointError as exc:
                    failure = str(exc)
            _raise_everywhere(broadcast_object(failure), rank=self.rank)
        if self._sharded is not None:
            self._sharded.wait()
        # The last uploads, in a checkpoint phase (the watchdog allows it longer).
        if self.mirror is not None:
            # The drain ends before torchrun's kill.
            grace = self.config.checkpoint.stop_timeout - 10 if self._stop.stopped else None
            with self._pauses.outside_training("checkpoint"):
                self.mirror.drain(None if grace is None else max(1.0, grace))
        self._stop.announce(self.progress.step, saved_in=self.config.checkpoint_dir)


def _nonfinite(model: Any, step: int) -> str | None:
    """This rank's verdict on its parameters (no collective): None when finite, else the error's message."""
    try:
        require_finite(model, what=f"the checkpoint of step {step}", collective=False)
    except HealthError as exc:
        return str(exc)
    return None


def _raise_everywhere(failure: str | None, *, rank: int) -> None:
    """Rank 0's failed write, as one line on every rank (others name rank 0): without it, the others would meet its
    closed connection at the next collective and print torch's traceback ("Connection closed by peer")."""
    if failure is not None:
        raise CheckpointError(failure if rank == 0 else f"rank 0 could not write the checkpoint: {failure}")
