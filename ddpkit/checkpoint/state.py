"""The run's state, one owner: which checkpoint a run resumes from, whether it may, how the
state is captured and restored, and when to save.

    state = RunState(config, runtime=runtime, progress=progress)
    state.register_all(model=model, optimizer=optimizer, progress=progress, rng=RngStreams(rank=0, world_size=2),
                       early_stopping=state.early_stopping, best=state.best, ...)   # every persisted part, by name, once
    resumed = state.resume()                        # once, after everything is built: restore or seed fresh
    events.add(*state.protections(ledger=ledger))   # the crash save and memory snapshots capture through this owner
    ...
    if state.due(after="step"):                     # the periodic schedule, or an agreed stop on a signal
        state.save(barrier=barrier)                 # rank 0 writes; every rank contributes its RNG state

What a checkpoint holds is decided by registration alone (:mod:`ddpkit.checkpoint.components`):
each registered name's ``state_dict()``, plus every rank's RNG streams and the run's config and
versions. The file is a plain dict, so ``torch.load(weights_only=True)`` reads it and ``ddpkit
export`` takes ``["model"]`` out.

Choosing the file: rank 0 alone resolves ``checkpoint.resume`` (so every rank agrees even if a
save lands meanwhile) and broadcasts the path; every rank then reads that file, which must be on
a filesystem all nodes share.

Stopping on a signal (:mod:`ddpkit.checkpoint.preemption`) is a save decision too: after the step every
rank agrees on, :meth:`RunState.due` asks for a checkpoint whatever the periodic schedule says,
the loop stops, and :meth:`RunState.raise_if_stopped` ends the run with exit code 75.

``checkpoint.every_steps: auto`` spaces periodic saves by Young/Daly from the measured save and
step times (:mod:`ddpkit.checkpoint.interval`): each save is timed, and re-estimates the interval.

Compatibility: fields that change the math (model, data order and batches, optimizer, schedule,
precision, seed, world size) must match, or the resumed run would silently differ from the run
it continues. Fields that only change bookkeeping (logging, how long to train, where to write,
checkpoint cadence, timeouts) may differ. The world size may differ when
``data.global_batch_size`` is set: the sample order then does not depend on it (:mod:`ddpkit.data.elastic`).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ddpkit._version import __version__
from ddpkit.checkpoint import files as ckpt
from ddpkit.checkpoint.components import Components, Ledger, Progress, Stateful, read_checkpoint
from ddpkit.checkpoint.crash_save import CrashSave
from ddpkit.checkpoint.interval import AutoInterval
from ddpkit.checkpoint.memory_tier import MemorySnapshots, prefer_newer
from ddpkit.checkpoint.preemption import Preempted, StopOnSignal
from ddpkit.checkpoint.sharded_run import TENSOR_PARTS, ShardedOptimizer, ShardedRun, full_capture, full_model_state, read_any, restore_components
from ddpkit.config.schema import Config
from ddpkit.config.serialize import config_hash, config_to_dict
from ddpkit.distributed.agreement import config_differences
from ddpkit.distributed.process_group import Runtime, broadcast_object
from ddpkit.errors import CheckpointError, report_error
from ddpkit.reporting.log import log
from ddpkit.training.metrics import BestTracker
from ddpkit.training.replicas import require_finite
from ddpkit.training.rng import seed_everything, use_deterministic_kernels

__all__ = ["Progress", "RunState", "seed_for_setup"]


def seed_for_setup(config: Config) -> None:
    """Seed every rank alike, so the initial weights and data are identical before DDP checks them
    (and, with ``train.deterministic``, make the kernels deterministic before the first one runs)."""
    if config.train.deterministic:
        use_deterministic_kernels()
    seed_everything(config.run.seed)


class RunState:
    """Owns the run's state: capture, save (and when), choose a file, check it, restore it."""

    def __init__(self, config: Config, *, runtime: Runtime, progress: Progress):
        self.config, self.runtime, self.progress = config, runtime, progress
        ck = config.checkpoint
        self._writer = ckpt.AsyncCheckpointWriter() if ck.async_save else None
        self._last_saved_step = -1
        self.components = Components()  # filled by one register_all call (the Trainer's), before resume()
        self._periodic = bool(ck.every_steps or ck.every_epochs or ck.best)
        self._auto = AutoInterval(ck.mtbf_hours) if ck.every_steps == "auto" else None  # Young/Daly, measured
        best, early = ck.best, config.train.early_stopping
        self.best = BestTracker(best.metric if best else None, best.mode if best else "min", key="checkpoint.best.metric")
        self.early_stopping = BestTracker(
            early.metric, early.mode, patience=early.patience, min_delta=early.min_delta, target=early.target, key="train.early_stopping.metric"
        )
        self._sharded = ShardedRun.for_config(config, self.components, rank=runtime.env.rank)  # zero1 / fsdp2: DCP directories
        env = runtime.env
        self.signals = StopOnSignal(ck.save_on_signals, store=runtime.store, rank=env.rank, world_size=env.world_size)
        self.stopped = False  # set at the optimizer step every rank agreed to stop at
        self._preempted: Preempted | None = None  # the stop, once announced by wait() on every rank

    # --- resume -----------------------------------------------------------------------------

    def resume(self) -> bool:
        """Restore the checkpoint ``checkpoint.resume`` names, or seed a fresh run; True if resumed.

        A fresh run reseeds every rank differently (independent dropout and augmentation); a
        resumed one restores each rank's RNG streams exactly where they were.
        """
        chosen = self._choose()
        if chosen is None:
            seed_everything(self.config.run.seed + self.runtime.env.rank)
            return False
        path, state = chosen
        self._check_compatible(state, path)
        restore_components(path, state, self.components, mode=self.config.parallel.mode)  # any format into any layout
        self._last_saved_step = self.progress.step
        log.info("resuming from %s (step %d)", path, self.progress.step)
        return True

    def _choose(self) -> tuple[str, dict[str, Any]] | None:
        choice = problem = None
        if self.runtime.env.rank == 0:
            try:
                info = prefer_newer(ckpt.resolve_resume_path(self.config.checkpoint.resume, self.config.checkpoint_dir), self.config)  # or /dev/shm
                choice = str(info.path) if info else None
            except CheckpointError as exc:
                problem = str(exc)
        choice, problem = broadcast_object((choice, problem))
        if problem is not None:
            raise CheckpointError(problem)
        if choice is None:
            return None
        return choice, read_checkpoint(read_any(choice), path=choice)  # a file, or a sharded checkpoint's state.pt

    def _check_compatible(self, state: dict[str, Any], path: str) -> None:
        world_size, elastic = self.runtime.env.world_size, self.config.data.global_batch_size is not None
        saved_world_size = state["world_size"]
        differences = config_differences(
            state["config"], config_to_dict(self.config), saved_world_size=saved_world_size, world_size=world_size, elastic=elastic
        )
        if elastic and saved_world_size != world_size and not differences:
            log.info(
                "resuming on %d rank(s) a run checkpointed on %d: same samples per step (data.global_batch_size=%d); "
                "each rank continues rank 0's random streams", world_size, saved_world_size, self.config.data.global_batch_size,
            )
        differences += _legacy_order_difference(state["config"], self.components)
        if differences and not self.config.checkpoint.allow_config_change:
            raise CheckpointError(
                f"cannot resume from {path}: it was written by a run whose config differs in fields that change the math:\n"
                + "\n".join(f"  - {d}" for d in differences)
                + "\nStart fresh with checkpoint.resume=none (or a new run.output_dir), or resume anyway with checkpoint.allow_config_change=true."
            )

    def register(self, name: str, component: Stateful | None) -> None:
        """Save ``component`` in every checkpoint from now on under ``name`` (None: nothing to save).

        Register before :meth:`resume` to be restored by it; a component registered later (e.g.
        the reporter's tracker sinks, which need to know whether the run resumed) receives the
        state the resumed checkpoint holds for ``name``, if any.
        """
        if self._sharded is not None and name == "optimizer" and component is not None:
            component = ShardedOptimizer(component)  # zero1 / fsdp2: never captured by one rank alone
        self.components.register(name, component)

    def register_all(self, **components: Stateful | None) -> None:
        """:meth:`register` each ``name=component`` in turn (None: nothing to save, e.g. no scheduler)."""
        for name, component in components.items():
            self.register(name, component)

    def protections(self, *, ledger: Ledger) -> list[CrashSave | MemorySnapshots | None]:
        """The listeners that protect this state between checkpoints, for the Trainer's events (after
        resume): the crash save of the last completed step, and memory snapshots every K steps."""
        return [CrashSave.arm(self.config, self.runtime, self, ledger=ledger), MemorySnapshots.arm(self.config, self.runtime, self, ledger=ledger)]

    # --- save ---------------------------------------------------------------------------------

    def capture(self, exclude: tuple[str, ...] = (), *, rng: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """Every registered part's state and the run's metadata, less ``exclude``: what a checkpoint holds.

        A collective (the ``rng`` part gathers every rank's streams), unless ``rng`` gives those
        streams: the crash save, whose dead peer can join no collective, reads them from files.
        """
        metadata = {
            "world_size": self.runtime.env.world_size,
            "config": config_to_dict(self.config),
            "config_hash": config_hash(self.config),
            "versions": {"ddpkit": __version__, "torch": str(torch.__version__)},
        }
        if rng is not None:
            state = self.components.capture(metadata=metadata, exclude=(*exclude, "rng"))
            return {**state, "rng": rng, "schema": [*state["schema"], "rng"]}
        if self._sharded is None or exclude:
            return self.components.capture(metadata=metadata, exclude=exclude)
        # A whole single-file state of a sharded run (memory snapshots): gathered on rank 0, a collective.
        return full_capture(self.components.capture(metadata=metadata, exclude=TENSOR_PARTS), self.components, rank=self.runtime.env.rank)

    def due(self, *, after: str) -> bool:
        """Whether the periodic schedule asks for a checkpoint now (``after`` is "step" or "epoch")."""
        ck, progress = self.config.checkpoint, self.progress
        if after == "step":
            if self._auto is not None:
                self._auto.tick()  # one clock read: the step times `auto` converts seconds with
            if self.signals.requested and not self.stopped and self.signals.agreed(progress.step):
                self.stopped = True  # the loop sees it in Trainer._finished(); this step is saved now
                return True
            if self._auto is not None:
                return self._auto.due(progress.step - max(0, self._last_saved_step))
            return bool(ck.every_steps) and progress.step % ck.every_steps == 0
        # After an epoch, progress.epoch already counts it.
        return bool(ck.every_epochs) and progress.epoch % ck.every_epochs == 0

    def after_evaluation(self, metrics: dict[str, float], *, save_best: Any) -> bool:
        """Call ``save_best()`` if ``checkpoint.best.metric`` improved; True when early stopping says stop.

        It stops at a reached ``train.early_stopping.target`` or when patience runs out; the metrics are
        rank-reduced, so every rank decides the same at the same step.
        """
        if self.best.update(metrics):
            save_best()
        tracker, early = self.early_stopping, self.config.train.early_stopping
        tracker.update(metrics)
        if tracker.reached:
            log.info("early stopping: %s %.4f %s train.early_stopping.target=%g (mode %s) at step %d",
                     early.metric, tracker.last, "<=" if early.mode == "min" else ">=", early.target, early.mode, self.progress.step)
            return True
        if not tracker.exhausted:
            return False
        log.info("early stopping: %s has not improved for %d evaluations", early.metric, early.patience)
        return True

    def saved_already(self, name: str | None = None) -> bool:
        """Whether a periodic save of this step is a repeat (a named one, e.g. "best", never is)."""
        return name is None and self._last_saved_step == self.progress.step

    def save(self, *, barrier: Any, name: str | None = None) -> None:
        """Rank 0 writes the state (once per step unless ``name`` is given, e.g. "best"); all ranks wait."""
        step = self.progress.step
        if self.saved_already(name):
            return
        started = time.perf_counter()
        require_finite(self.components["model"], what=f"the checkpoint of step {step}")  # every rank agrees; nothing pruned
        failure: CheckpointError | None = None
        if self._sharded is not None:  # zero1 / fsdp2: every rank writes its own shards
            self._sharded.save(self.capture, self.config.checkpoint_dir, step=step, name=name, keep_last=self.config.checkpoint.keep_last)
        elif (state := self.capture()) and self.runtime.env.rank == 0:  # capture is a collective: every rank runs it
            ck = self.config.checkpoint
            meta = {"epoch": self.progress.epoch, "config_hash": state["config_hash"], "versions": state["versions"]}
            kwargs = dict(step=step, name=name, keep_last=ck.keep_last, meta=meta)
            if self._writer is not None:
                self._writer.stage_and_submit(state, self.config.checkpoint_dir, **kwargs)  # only queues the copies on a GPU
            else:
                try:
                    ckpt.save_checkpoint(state, self.config.checkpoint_dir, **kwargs)
                except CheckpointError as exc:  # a full disk, a quota: every rank must hear it (below)
                    failure = exc
        if self._writer is None:
            if self._sharded is None:
                _raise_on_every_rank(failure)
            barrier("checkpoint")
        if name is None:
            self._last_saved_step = step
        if self._auto is not None:  # every rank: one broadcast of rank 0's measurements
            self._auto.saved(blocked=time.perf_counter() - started, since=max(0, self._last_saved_step))

    @property
    def enabled(self) -> bool:
        """Whether the run ends with a checkpoint: when checkpointing is configured, or a signal stopped it."""
        return self._periodic or self.stopped

    def raise_if_stopped(self) -> None:
        """After the run's last save and flush: end a signal-stopped run with :class:`Preempted` (exit code 75)."""
        if self.stopped:
            raise self._preempted or self._stop_error()

    def _stop_error(self) -> Preempted:
        return Preempted(
            f"{self.signals.describe()}: step {self.progress.step} is saved in {self.config.checkpoint_dir}; "
            "run the same command again to resume from it"
        )

    def close(self, status: str | None = None) -> None:
        """Stop listening for signals (the previous handlers come back); ``status`` is not needed."""
        self.signals.close()

    def save_model(self, path: Any) -> None:
        """The bare model's weights as a plain state_dict of CPU tensors (``model.pt``): what inference loads,
        on any machine. Call on every rank."""
        weights = full_model_state(self.components["model"])  # fsdp2: the shards gathered (a collective)
        weights = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in weights.items()}  # loads on any machine
        if self.runtime.env.rank != 0:
            return
        require_finite(self.components["model"], what=str(path), collective=False)  # rank 0 alone writes it
        ckpt.save_atomically(weights, path)
        log.info("saved %s", path)

    def rollback(self, names: tuple[str, ...] = ("model", "optimizer", "scheduler", "scaler")) -> bool:
        """Load ``names`` from the newest valid checkpoint (every rank; progress, data and RNG go on); False if none.

        ``health.spike.action=rollback``: the weights and optimizer go back, the run continues past the batches
        that spiked instead of meeting them again.
        """
        info = ckpt.find_latest_checkpoint(self.config.checkpoint_dir) if self.runtime.env.rank == 0 else None
        path = broadcast_object(str(info.path) if info is not None and info.path.suffix == ".pt" else None)
        if path is None:
            return False
        loaded = self.components.load(read_checkpoint(ckpt.load_checkpoint(path), path=path), names)
        log.info("rolled back %s to %s", ", ".join(loaded), path)
        return True

    def wait(self) -> None:
        """Block until a background save, if any, is on disk; then, if a signal stopped the run, say so.

        Every rank prints its stop line here, before the run's last barrier: once one rank exits
        (code 75), torchrun's agent ends the others, so a line printed on the way out may be cut off.
        """
        if self._writer is not None:
            self._writer.wait()
        if self._sharded is not None:
            self._sharded.wait()
        if self.stopped and self._preempted is None:
            self._preempted = self._stop_error()
            env = self.runtime.env
            report_error(self._preempted, command="ddpkit", rank=env.rank if env.world_size > 1 else None)


def _legacy_order_difference(saved: dict[str, Any], components: Components) -> list[str]:
    """A checkpoint from before ``data.order`` existed drew its samples by ``randperm``; ``auto`` may now mean another order."""
    current = getattr(components["data_order"], "resolved", None) if "data_order" in components.names else None
    if "order" in saved.get("data", {}) or current in (None, "randperm", "sequential"):
        return []
    return [f"data.order: the checkpoint predates it and used 'randperm'; this run would use {current!r} (set data.order=randperm)"]


def _raise_on_every_rank(failure: CheckpointError | None) -> None:
    """Rank 0's write outcome, on every rank (one broadcast): a failed write ends every rank with its message.

    Were rank 0 to leave alone, the others would meet its closed connection in the barrier after the
    save and print torch's traceback ("Connection closed by peer") under rank 0's clear line.
    """
    message = broadcast_object(None if failure is None else str(failure))
    if failure is not None:
        raise failure
    if message is not None:
        raise CheckpointError(f"rank 0 could not write the checkpoint: {message}")
