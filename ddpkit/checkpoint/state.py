"""The run's state, one owner: what a checkpoint holds, which file a run resumes from, whether it
may, how every part is captured and restored, and when to save.

    state = RunState(parts, config, runtime=runtime)
    state.resume()                      # once, after everything is built: restore or seed fresh
    ...
    state.save_if_due(after="step")     # rank 0 writes; every rank contributes its RNG state

A checkpoint file is a :class:`Checkpoint`: named fields, written as a plain dict so that
``torch.load(weights_only=True)`` reads it and ``ddpkit export`` can take ``["model"]`` out.
The parts it covers are the live objects of :class:`TrainingParts`; each has ``state_dict`` /
``load_state_dict``. Extra components (early stopping, the best-checkpoint tracker, and whatever
a feature adds: a data position, a tracker's run id) join by name in ``TrainingParts.components``.

Choosing the file: rank 0 alone resolves ``checkpoint.resume`` (so every rank agrees even if a
save lands meanwhile) and broadcasts the path; every rank then reads that file, which must be on
a filesystem all nodes share.

Stopping on a signal (:mod:`ddpkit.faults.preemption`) is a save decision too: after the step every
rank agrees on, :meth:`RunState.due` asks for a checkpoint whatever the periodic schedule says,
the loop stops, and :meth:`RunState.raise_if_stopped` ends the run with exit code 75.

Compatibility: fields that change the math (model, data order and batches, optimizer, schedule,
precision, seed, world size) must match, or the resumed run would silently differ from the run
it continues. Fields that only change bookkeeping (logging, how long to train, where to write,
checkpoint cadence, timeouts) may differ. The world size may differ when
``data.global_batch_size`` is set: the sample order then does not depend on it (:mod:`ddpkit.data.elastic`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from ddpkit._version import __version__
from ddpkit.checkpoint import files as ckpt
from ddpkit.config.schema import Config
from ddpkit.config.serialize import config_hash, config_to_dict
from ddpkit.distributed.agreement import check_same_run_on_every_rank, config_differences
from ddpkit.distributed.process_group import Runtime, all_gather_object, broadcast_object
from ddpkit.errors import CheckpointError
from ddpkit.faults.preemption import Preempted, StopOnSignal
from ddpkit.reporting.log import log
from ddpkit.training.metrics import BestTracker
from ddpkit.training.rng import capture_rng, restore_rng, seed_everything

__all__ = [
    "Progress", "TrainingParts", "Checkpoint", "RunState",
    "seed_for_setup",
]



@dataclass
class Progress:
    """Where training is: optimizer steps taken, current epoch, micro-batches consumed in it."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0


@dataclass
class TrainingParts:
    """The live objects a checkpoint captures. ``model`` is the bare model (never the DDP wrapper)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any = None
    scaler: Any = None
    progress: Progress = field(default_factory=Progress)
    #: Named extras with ``state_dict()`` / ``load_state_dict()``: trackers, data position, ...
    components: dict[str, Any] = field(default_factory=dict)


@dataclass
class Checkpoint:
    """What a checkpoint file holds. Saved as ``to_dict()``; read back with :meth:`from_dict`."""

    model: dict[str, Any]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any] | None
    scaler: dict[str, Any] | None
    progress: dict[str, int]
    rng: list[dict[str, Any]]  # one per rank, in rank order
    components: dict[str, Any]
    world_size: int
    config: dict[str, Any]
    config_hash: str
    versions: dict[str, str]

    def to_dict(self) -> dict[str, Any]:
        # Not dataclasses.asdict: it deep-copies every tensor of the model and optimizer.
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, path: str) -> Checkpoint:
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [name for name in names if name not in raw]
        if missing:
            raise CheckpointError(
                f"{path} lacks {', '.join(missing)}: it was not written by this version of ddpkit's Trainer. "
                "Start fresh with checkpoint.resume=none, or load its weights yourself (`ddpkit export`)."
            )
        return cls(**{name: raw[name] for name in names})

    def manifest_meta(self) -> dict[str, Any]:
        """What the manifest beside the file records, for tools that list checkpoints."""
        return {"epoch": self.progress["epoch"], "config_hash": self.config_hash, "versions": self.versions}


def seed_for_setup(config: Config) -> None:
    """Seed every rank alike, so the initial weights and data are identical before DDP checks them."""
    seed_everything(config.run.seed)


class RunState:
    """Owns the run's state: capture, save (and when), choose a file, check it, restore it."""

    def __init__(self, parts: TrainingParts, config: Config, *, runtime: Runtime):
        self.parts, self.config, self.runtime = parts, config, runtime
        ck = config.checkpoint
        self._writer = ckpt.AsyncCheckpointWriter() if ck.async_save else None
        self._last_saved_step = -1
        self._restored_components: dict[str, Any] = {}
        self._periodic = bool(ck.every_steps or ck.every_epochs or ck.best)
        best, early = ck.best, config.train.early_stopping
        self.best = BestTracker(best.metric if best else None, best.mode if best else "min", key="checkpoint.best.metric")
        self.early_stopping = BestTracker(
            early.metric, early.mode, patience=early.patience, min_delta=early.min_delta, key="train.early_stopping.metric"
        )
        parts.components.update(early_stopping=self.early_stopping, best=self.best)
        env = runtime.env
        self.signals = StopOnSignal(ck.save_on_signals, store=runtime.store, rank=env.rank, world_size=env.world_size)
        self.stopped = False  # set at the optimizer step every rank agreed to stop at

    @property
    def progress(self) -> Progress:
        return self.parts.progress

    @property
    def outcome(self) -> str:
        """How the run ended, as trackers say it: ``FINISHED``, or ``KILLED`` when a signal stopped it."""
        return "KILLED" if self.stopped else "FINISHED"

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
        self._restore(state)
        log.info("resuming from %s (step %d)", path, self.progress.step)
        return True

    def _choose(self) -> tuple[str, Checkpoint] | None:
        choice = problem = None
        if self.runtime.env.rank == 0:
            try:
                info = ckpt.resolve_resume_path(self.config.checkpoint.resume, self.config.checkpoint_dir)
                choice = str(info.path) if info else None
            except CheckpointError as exc:
                problem = str(exc)
        choice, problem = broadcast_object((choice, problem))
        if problem is not None:
            raise CheckpointError(problem)
        if choice is None:
            return None
        return choice, Checkpoint.from_dict(ckpt.load_checkpoint(choice), path=choice)

    def _check_compatible(self, state: Checkpoint, path: str) -> None:
        world_size, elastic = self.runtime.env.world_size, self.config.data.global_batch_size is not None
        differences = config_differences(
            state.config, config_to_dict(self.config), saved_world_size=state.world_size, world_size=world_size, elastic=elastic
        )
        if elastic and state.world_size != world_size and not differences:
            log.info(
                "resuming on %d rank(s) a run checkpointed on %d: same samples per step (data.global_batch_size=%d); "
                "each rank continues rank 0's random streams", world_size, state.world_size, self.config.data.global_batch_size,
            )
        if differences and not self.config.checkpoint.allow_config_change:
            raise CheckpointError(
                f"cannot resume from {path}: it was written by a run whose config differs in fields that change the math:\n"
                + "\n".join(f"  - {d}" for d in differences)
                + "\nStart fresh with checkpoint.resume=none (or a new run.output_dir), or resume anyway with checkpoint.allow_config_change=true."
            )

    def _restore(self, state: Checkpoint) -> None:
        parts = self.parts
        parts.model.load_state_dict(state.model)
        parts.optimizer.load_state_dict(state.optimizer)
        if parts.scheduler is not None and state.scheduler is not None:
            parts.scheduler.load_state_dict(state.scheduler)
        if parts.scaler is not None and state.scaler is not None:
            parts.scaler.load_state_dict(state.scaler)
        parts.progress = Progress(**state.progress)
        self._restored_components = dict(state.components)
        for name, component in parts.components.items():
            component.load_state_dict(state.components.get(name, {}))
        self._last_saved_step = parts.progress.step
        rank, world_size = self.runtime.env.rank, self.runtime.env.world_size
        # Each rank continues its own streams; a run allowed onto another world size takes rank 0's.
        restore_rng(state.rng[rank] if len(state.rng) == world_size else state.rng[0])

    def check_same_run_on_every_rank(self, train_set: Any, val_set: Any) -> None:
        """Stop every rank with the differences if ranks built different configs, models or datasets."""
        check_same_run_on_every_rank(self.config, self.parts.model, train_set, val_set)

    def register(self, name: str, component: Any) -> None:
        """Add a component built after resume (e.g. the reporter's tracker sinks, which need to know
        whether the run resumed): saved in every checkpoint from now on, and handed the state the
        resumed checkpoint holds for ``name``, if any."""
        self.parts.components[name] = component
        if name in self._restored_components:
            component.load_state_dict(self._restored_components[name])

    # --- save ---------------------------------------------------------------------------------

    def capture(self) -> Checkpoint:
        """Everything needed to continue exactly (a collective: gathers every rank's RNG states)."""
        parts = self.parts
        rng_states = all_gather_object(capture_rng())
        return Checkpoint(
            model=parts.model.state_dict(),
            optimizer=parts.optimizer.state_dict(),
            scheduler=parts.scheduler.state_dict() if parts.scheduler is not None else None,
            scaler=parts.scaler.state_dict() if parts.scaler is not None else None,
            progress=dataclasses.asdict(parts.progress),
            rng=rng_states,
            components={name: component.state_dict() for name, component in parts.components.items()},
            world_size=self.runtime.env.world_size,
            config=config_to_dict(self.config),
            config_hash=config_hash(self.config),
            versions={"ddpkit": __version__, "torch": str(torch.__version__)},
        )

    def due(self, *, after: str) -> bool:
        """Whether the periodic schedule asks for a checkpoint now (``after`` is "step" or "epoch")."""
        ck, progress = self.config.checkpoint, self.progress
        if after == "step":
            if self.signals.requested and not self.stopped and self.signals.agreed(progress.step):
                self.stopped = True  # the loop sees it in Trainer._finished(); this step is saved now
                return True
            return bool(ck.every_steps) and progress.step % ck.every_steps == 0
        # After an epoch, progress.epoch already counts it.
        return bool(ck.every_epochs) and progress.epoch % ck.every_epochs == 0

    def after_evaluation(self, metrics: dict[str, float], *, save_best: Any) -> bool:
        """Call ``save_best()`` if ``checkpoint.best.metric`` improved; True when early stopping says stop."""
        if self.best.update(metrics):
            save_best()
        self.early_stopping.update(metrics)
        if not self.early_stopping.exhausted:
            return False
        early = self.config.train.early_stopping
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
        state = self.capture()
        if self.runtime.env.rank == 0:
            ck = self.config.checkpoint
            kwargs = dict(step=step, name=name, keep_last=ck.keep_last, meta=state.manifest_meta())
            if self._writer is not None:
                self._writer.submit(ckpt.to_cpu(state.to_dict()), self.config.checkpoint_dir, **kwargs)
            else:
                ckpt.save_checkpoint(state.to_dict(), self.config.checkpoint_dir, **kwargs)
        if self._writer is None:
            barrier("checkpoint")
        if name is None:
            self._last_saved_step = step

    @property
    def enabled(self) -> bool:
        """Whether the run ends with a checkpoint: when checkpointing is configured, or a signal stopped it."""
        return self._periodic or self.stopped

    def raise_if_stopped(self) -> None:
        """After the run's last save and flush: end a signal-stopped run with :class:`Preempted` (exit code 75)."""
        if self.stopped:
            raise Preempted(
                f"{self.signals.describe()}: step {self.progress.step} is saved in {self.config.checkpoint_dir}; "
                "run the same command again to resume from it"
            )

    def close(self) -> None:
        """Stop listening for signals (the previous handlers come back)."""
        self.signals.close()

    def save_model(self, path: Any) -> None:
        """The bare model's weights as a plain state_dict (``model.pt``): what inference loads."""
        ckpt.save_atomically(self.parts.model.state_dict(), path)
        log.info("saved %s", path)

    def wait(self) -> None:
        """Block until a background save, if any, is on disk."""
        if self._writer is not None:
            self._writer.wait()
