"""Validation inside the loop: exact metrics over the whole validation set, then what they decide.

    evaluation = Evaluation(models, val_loader, device=device, autocast=step.autocast, ticking=watchdog.ticking)
    metrics = evaluation.validate(validation_step)       # {"val_loss": ..., "val_accuracy": ...}, on every rank
    evaluation.active                                    # True while it runs (the Trainer's ``model`` is the bare one)
    evaluation.last_step                                 # the optimizer step of the last validation (-1: none yet)
    Evaluation(models, val_loader, ..., pipeline=pipeline)   # under parallel.pipeline: through the stages

Every rank runs ``validation_step`` over its exact, duplicate-free shard (:func:`ddpkit.training.metrics.evaluate`)
on the bare model. Under FSDP2 each forward gathers one unit's parameters and frees them after, as training does,
so no rank ever holds the whole model: every rank then runs as many forwards, a rank with fewer batches running its
last one again and dropping its metrics (:func:`lockstep_forwards`). Where that cannot be agreed (a rank without a
validation batch, a loader without a length), the parameters are gathered once for the whole pass instead. Each
batch counts as progress for the hang watchdog (``ticking``): a long validation is not a hang. Under a pipeline each
batch goes forward through the stages and ``validation_step`` runs on the last
(:mod:`ddpkit.training.evaluation_pipeline`); the metrics are as exact.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ddpkit.distributed.collectives import all_reduce_max
from ddpkit.parallel.model_views import Models
from ddpkit.training.evaluation_pipeline import evaluate_pipeline
from ddpkit.training.metrics import evaluate

if TYPE_CHECKING:
    from ddpkit.parallel.pipeline import Pipeline

__all__ = ["Evaluation"]


class Evaluation:
    """The loop's validations of one run, on one rank."""

    def __init__(
        self,
        models: Models,
        loader: Any,
        *,
        device: torch.device,
        autocast: Callable[[], Any],
        ticking: Callable[[Callable[..., Any]], Callable[..., Any]] = lambda fn: fn,
        pipeline: Pipeline | None = None,
    ):
        self.models = models
        self.loader = loader
        self.device = device
        self.autocast = autocast
        self.ticking = ticking
        self.pipeline = pipeline
        self.active = False
        self.last_step = -1

    def validate(
        self, step: Callable[[Any], Mapping[str, torch.Tensor]], *, at_step: int | None = None
    ) -> dict[str, float]:
        """``step`` over every validation batch; the exact ``val_`` means ({} without a validation set)."""
        if at_step is not None:
            self.last_step = at_step
        if self.loader is None:
            return {}
        self.active = True
        try:
            parts = self.pipeline.forward.stages if self.pipeline is not None else [self.models.bare]
            gathers = any(self.models.data_parallel.gathers_in_forward(part) for part in parts)
            forwards = lockstep_forwards(self.loader, device=self.device) if gathers else None
            if self.pipeline is not None:
                return evaluate_pipeline(
                    self.pipeline.forward,
                    self.models.bare,
                    self.loader,
                    self.ticking(step),
                    device=self.device,
                    autocast=self.autocast,
                    data_parallel=self.models.data_parallel,
                    forwards=forwards,
                )
            with self.models.for_evaluation(lockstep=forwards is not None):
                return evaluate(
                    self.models.bare,
                    self.loader,
                    self.ticking(step),
                    device=self.device,
                    autocast=self.autocast,
                    forwards=forwards,
                )
        finally:
            self.active = False


def lockstep_forwards(loader: Any, *, device: torch.device) -> int | None:
    """The most validation batches any rank has (one all-reduce): under fsdp2 each forward all-gathers a unit's
    parameters, so every rank runs that many forwards and a unit's full parameters live only for its forward, as in
    training. None when some rank's loader has no length or no batch at all (nothing to run again): the parameters
    are then gathered whole once for the pass, and no forward is a collective."""
    try:
        mine = len(loader)
    except TypeError:
        mine = 0
    # The largest count and, negated, the smallest, in one reduction.
    most, least = all_reduce_max(torch.tensor([mine, -mine], device=device)).tolist()
    return most if -least > 0 else None
