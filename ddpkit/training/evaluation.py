"""Validation inside the loop: exact metrics over the whole validation set, then what they decide.

    evaluation = Evaluation(models, val_loader, device=device, autocast=step.autocast, ticking=watchdog.ticking)
    metrics = evaluation.validate(validation_step)       # {"val_loss": ..., "val_accuracy": ...}, on every rank
    evaluation.active                                    # True while it runs (the Trainer's ``model`` is the bare one)
    evaluation.last_step                                 # the optimizer step of the last validation (-1: none yet)
    Evaluation(models, val_loader, ..., pipeline=pipeline)   # under parallel.pipeline: through the stages

Every rank runs ``validation_step`` over its exact, duplicate-free shard (:func:`ddpkit.training.metrics.evaluate`)
on the bare model, so a rank with fewer batches never waits on a collective; under FSDP2 the
parameters are gathered once for the whole pass. Each batch counts as progress for the hang
watchdog (``ticking``): a long validation is not a hang. Under a pipeline each batch goes forward through the
stages and ``validation_step`` runs on the last (:mod:`ddpkit.training.evaluation_pipeline`); the metrics are as exact.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

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
            if self.pipeline is not None:
                return evaluate_pipeline(
                    self.pipeline.forward,
                    self.models.bare,
                    self.loader,
                    self.ticking(step),
                    device=self.device,
                    autocast=self.autocast,
                    data_parallel=self.models.data_parallel,
                )
            # fsdp2: parameters gathered once, no collective per batch.
            with self.models.for_evaluation():
                return evaluate(
                    self.models.bare, self.loader, self.ticking(step), device=self.device, autocast=self.autocast
                )
        finally:
            self.active = False
