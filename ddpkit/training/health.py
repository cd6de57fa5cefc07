"""Training health: a NaN, a loss spike, a slow rank or a diverged replica is caught, named and
handled by every rank together, at the same step.

    health = TrainingHealth(config, runtime=runtime, model=model, loader=train_loader, progress=progress,
                            checkpoints=checkpointer)
    OptimizerStep(..., health=health)   # it calls watch_loss() and allow_step(), see below
    checkpointer.register(builtin={"health": health, ...})   # the counters and spike windows continue after a resume
    events.add(health.straggler, health)         # the straggler watch times the data span; on_step_end below
    ...
    health.on_step_end(step)            # straggler and replica checks, every N steps (None when both are off)
    reporter.training(progress, lr=lr, extra=health.log_fields())   # grad_norm, skipped_steps, ...

Configured by the ``health`` section (:mod:`ddpkit.config.health_section`); docs/health.md has the
costs as measured. What happens in an optimizer step:

* ``watch_loss(loss)`` (each micro-batch, before backward) multiplies the loss by ``loss * 0 + 1``:
  exactly 1 when the loss is finite, NaN when it is not (on the CPU it reads the loss and
  multiplies by NaN only then), so a rank's non-finite loss makes its gradients NaN and DDP's
  all-reduce makes every rank's gradients NaN. The ranks agree that the
  step is bad without a collective of their own.
* ``allow_step(norm)`` (after the gradient norm, computed once: the clip's when clipping) reads the
  norm on the host. Non-finite: every rank sees it; one ``all_gather_object`` (only then) collects
  which ranks' losses were non-finite and their batches' sample indices, rank 0 logs them, and
  every rank skips the optimizer and scheduler step (``nonfinite: skip``) or raises
  :class:`~ddpkit.errors.HealthError` (``stop``). ``max_skips`` skips in a row also raise. With fp16,
  non-finite gradients from finite losses are the GradScaler's business: it skips, and it is counted.
* With ``spike`` on, one small all_reduce per step gives every rank the same mean loss; a loss or
  norm ``sigma`` standard deviations above its window is warned about, skipped, or rolled back
  (the newest valid checkpoint's weights and optimizer, through ``checkpoints.rollback()``; the data goes on).
  The all_reduce carries ``(mean loss, 1)`` from each rank that computed losses and ``(0, 0)`` from one that did
  not, so the mean is over the ranks that hold the loss. Rollback reads single files and sharded (DCP) checkpoints.

Under a pipeline the schedule runs the backward, and only the last stage computes losses: its loss function is
poisoned as ``watch_loss`` poisons one (:func:`ddpkit.training.health_checks.watched`), and the step hands the
schedule's losses to :meth:`TrainingHealth.record`, so a NaN names the step, the last stage's rank and its samples
and the spike detector reads the real loss, at no collective more. The straggler watch compares each stage's ranks
with one another (stages do different work), and the replica check each stage's replicas with their first.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch

from ddpkit.config.schema import Config
from ddpkit.distributed.collectives import all_gather_object, all_reduce_sum
from ddpkit.distributed.process_group import Runtime
from ddpkit.errors import HealthError
from ddpkit.parallel.layout import ParallelLayout, data_parallel_for
from ddpkit.progress import Progress
from ddpkit.reporting.log import GRAD_NORM, log
from ddpkit.training.health_checks import SpikeDetector, poison_nonfinite, sample_indices
from ddpkit.training.replicas import ReplicaCheck
from ddpkit.training.straggler import StragglerWatch

__all__ = ["TrainingHealth", "Rollback"]


class Rollback(Protocol):
    """What ``health.spike.action=rollback`` restores from: True when it loaded the newest valid checkpoint."""

    def rollback(self) -> bool: ...


class TrainingHealth:
    """The ``health`` section's checks for one run, on one rank; every decision is the same on every rank."""

    def __init__(
        self,
        config: Config,
        *,
        runtime: Runtime,
        model: torch.nn.Module,
        loader: Any,
        progress: Progress,
        checkpoints: Rollback | None = None,
        layout: ParallelLayout | None = None,
    ):
        """``checkpoints`` (the run's :class:`ddpkit.checkpoint.checkpointer.Checkpointer`): what
        ``health.spike.action=rollback`` restores the newest valid checkpoint's weights and optimizer from.
        ``layout``: which ranks are replicas of one another (under a pipeline, those of one stage)."""
        h = config.health
        env = runtime.env
        self.cfg = h
        self.rank = env.rank
        self.world_size = env.world_size
        self.device = runtime.device
        self.loader = loader
        self.progress = progress
        self.counts = {
            "skipped_steps": 0,
            "nonfinite_steps": 0,
            "scaler_skips": 0,
            "spikes": 0,
            "rollbacks": 0,
            "divergences": 0,
        }
        self._checkpoints = checkpoints
        #: This step's micro-batch losses, detached.
        self._losses: list[torch.Tensor] = []
        #: Healthy steps' norms since the last record.
        self._norms: list[float] = []
        self._in_a_row = 0
        spike = h.spike
        self.spikes = (
            {
                name: SpikeDetector(sigma=spike.sigma, window=spike.window, warmup=spike.warmup)
                for name in ("loss", GRAD_NORM)
            }
            if spike
            else {}
        )
        self.straggler, self.replicas = _rank_checks(config, runtime=runtime, model=model, layout=layout)
        if self.straggler is None and self.replicas is None:
            # Nothing to check after a step: the events skip a None (no call a step).
            self.on_step_end = None

    # --- inside the optimizer step (called by OptimizerStep) ------------------------------------

    def watch_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to backpropagate: the same value, with NaN gradients if it is not finite
        (:func:`ddpkit.training.health_checks.poison_nonfinite`)."""
        self._losses.append(loss.detach())
        return poison_nonfinite(loss)

    def record(self, losses: list[torch.Tensor]) -> None:
        """A pipeline's step: the losses the schedule computed on the last stage (none on the others), whose backward
        it ran itself through a loss function :func:`~ddpkit.training.health_checks.watched` poisoned."""
        self._losses.extend(loss.detach() for loss in losses)

    def allow_step(self, norm: torch.Tensor, *, scaled: bool = False) -> bool:
        """Whether to apply this step's update (False: skip it); ``scaled``: a GradScaler decides on overflow."""
        step = self.progress.step + 1
        losses = self._losses
        self._losses = []
        if hasattr(norm, "full_tensor"):
            # fsdp2: a DTensor of the sharded gradients' norm.
            norm = norm.full_tensor()
        # The step's one host read: the decision must be known before optimizer.step().
        value = float(norm)
        if not math.isfinite(value):
            return self._nonfinite(step, losses, scaled=scaled)
        if self.spikes and self._spiked(step, losses, value):
            return False
        self._norms.append(value)
        self._in_a_row = 0
        return True

    def _nonfinite(self, step: int, losses: list[torch.Tensor], *, scaled: bool) -> bool:
        bad = [i for i, v in enumerate(torch.stack(losses).float().tolist()) if not math.isfinite(v)] if losses else []
        first = self.progress.batch_in_epoch - len(losses)
        indices = [sample_indices(self.loader, epoch=self.progress.epoch, first_batch=first + i, count=1) for i in bad]
        # A collective, only on a bad step.
        reports = all_gather_object((bool(bad), [i for batch in indices if batch for i in batch]))
        ranks = [r for r, (was_bad, _) in enumerate(reports) if was_bad]
        if not ranks and scaled:
            # fp16 overflow: the GradScaler skips the step and lowers its scale.
            self.counts["scaler_skips"] += 1
            return True
        self.counts["nonfinite_steps"] += 1
        where = (
            f"non-finite loss on rank(s) {', '.join(map(str, ranks))}"
            if ranks
            else ("non-finite gradients after the all-reduce (the loss was finite on every rank)")
        )
        samples = "".join(
            f"; rank {r}'s batch had samples {_short(ix)} of epoch {self.progress.epoch}"
            for r, (b, ix) in enumerate(reports)
            if b and ix
        )
        if self.cfg.nonfinite == "stop":
            raise HealthError(
                f"step {step}: {where}{samples}; stopped (health.nonfinite=stop) before the update, so the weights and "
                "checkpoints stay finite. Look at those samples and the learning rate, "
                "or set health.nonfinite=skip to skip such steps."
            )
        return self._skip(step, where + samples)

    def _spiked(self, step: int, losses: list[torch.Tensor], norm: float) -> bool:
        """Check the step's mean loss (one all_reduce) and norm against their windows; True to skip the update."""
        # (mean, 1) from a rank that computed losses, (0, 0) from one that did not (a pipeline's other stages): the
        # sum over every rank divided by the count is the mean over the ranks that hold the loss, the same everywhere.
        if losses:
            total = torch.stack([torch.stack(losses).float().mean(), torch.ones((), device=losses[0].device)])
        else:
            total = torch.zeros(2, device=self.device)
        loss_sum, holders = all_reduce_sum(total).tolist()
        values = {"loss": loss_sum / max(holders, 1.0), GRAD_NORM: norm}
        spiked = [
            f"{name} {v:.4g} (window mean {_mean(self.spikes[name])})"
            for name, v in values.items()
            if self.spikes[name].is_spike(v)
        ]
        if not spiked:
            for name, v in values.items():
                self.spikes[name].add(v)
            return False
        self.counts["spikes"] += 1
        what = f"spike: {', '.join(spiked)}, over {self.cfg.spike.sigma:g} sigma"
        action = self.cfg.spike.action
        if action == "warn":
            self._say("step %d: %s (health.spike.action=warn)", step, what)
            return False
        if action == "rollback" and self._checkpoints is not None and self._checkpoints.rollback():
            self.counts["rollbacks"] += 1
            what += (
                "; rolled back to the newest valid checkpoint's weights and optimizer, and going on past these batches"
            )
        self._skip(step, what)
        return True

    def _skip(self, step: int, why: str) -> bool:
        """Count and log a skipped update (False: do not apply it), or raise after ``max_skips`` in a row."""
        self.counts["skipped_steps"] += 1
        self._in_a_row += 1
        if self._in_a_row >= self.cfg.max_skips:
            raise HealthError(
                f"step {step}: {why}; that is {self._in_a_row} skipped steps in a row "
                f"(health.max_skips={self.cfg.max_skips}): stopping. The checkpoints on disk are from before the "
                "trouble; lower the learning rate or look at the data, or raise health.max_skips."
            )
        self._say(
            "step %d: %s; skipped the optimizer and scheduler step on every rank (%d in a row, at most %d)",
            step,
            why,
            self._in_a_row,
            self.cfg.max_skips,
        )
        return False

    def _say(self, fmt: str, *args: Any) -> None:
        # Every rank took the same decision: one line is enough.
        if self.rank == 0:
            log.warning(fmt, *args)

    # --- after the step, and at log time ------------------------------------------------------

    def on_step_end(self, step: int) -> None:
        """Every step: close the straggler timings (a collective every ``straggler.every`` steps) and check
        replicas when due."""
        if self.straggler is not None and (message := self.straggler.step_done()):
            self._say("%s", message)
        if self.replicas is not None and step % self.cfg.check_replicas_every == 0 and self.replicas(step=step):
            self.counts["divergences"] += 1

    def log_fields(self) -> dict[str, float]:
        """The health metrics of a training record: mean ``grad_norm`` since the last record and the counters."""
        norms = self._norms
        self._norms = []
        fields: dict[str, float] = {GRAD_NORM: math.fsum(norms) / len(norms)} if norms else {}
        fields.update(self.counts)
        if self.straggler is not None:
            named = self.straggler.named
            fields.update(
                straggler_rank=named[0] if named else -1, straggler_slowdown=round(named[1], 3) if named else 0.0
            )
        return fields

    def state_dict(self) -> dict[str, Any]:
        return {"counts": dict(self.counts), "spikes": {name: d.state_dict() for name, d in self.spikes.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counts.update(state.get("counts", {}))
        for name, saved in state.get("spikes", {}).items():
            if name in self.spikes:
                self.spikes[name].load_state_dict(saved)

    def on_exit(self, status: str) -> None:
        """The run ended: stop the straggler watch's timer."""
        if self.straggler is not None:
            self.straggler.close()


def _rank_checks(
    config: Config, *, runtime: Runtime, model: torch.nn.Module, layout: ParallelLayout | None = None
) -> tuple[StragglerWatch | None, ReplicaCheck | None]:
    """The checks that compare ranks (none in a world of one); under a pipeline, each stage's ranks with one another."""
    h = config.health
    env = runtime.env
    if env.world_size == 1:
        return None, None
    if layout is None:
        layout = ParallelLayout.without_mesh(data_parallel_for(config.parallel), env)
    # A stage's ranks: dp x tp neighbours (the mesh's pipeline dimension is outermost)
    peers = env.world_size // layout.pp
    straggler = None
    if h.straggler and peers > 1:
        straggler = StragglerWatch(
            h.straggler,
            parameters=model.parameters(),
            rank=env.rank,
            world_size=env.world_size,
            device=runtime.device,
            peers=peers,
        )
    elif h.straggler and env.rank == 0:
        log.info("health.straggler: each stage has one rank, and stages do different work: nothing to compare")
    replicas = None
    # fsdp2 shards the parameters: nothing to compare; under a pipeline each stage's replicas are compared
    if h.check_replicas_every and layout.replicated and layout.dp > 1:
        replicas = ReplicaCheck(
            model,
            rank=env.rank,
            world_size=env.world_size,
            device=runtime.device,
            on_divergence=h.on_divergence,
            replicas=layout.dp,
            group=layout.dp_group,
        )
    return straggler, replicas


def _short(indices: list[int], limit: int = 16) -> str:
    shown = ", ".join(map(str, indices[:limit]))
    return f"[{shown}{', ...' if len(indices) > limit else ''}]"


def _mean(detector: SpikeDetector) -> str:
    return f"{sum(detector.values) / len(detector.values):.4g}" if detector.values else "n/a"
