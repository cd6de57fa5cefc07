"""Which step object a run trains with: accumulation, or a pipeline schedule (``parallel.pipeline > 1``).

step = build_train_step(update, models.train, pipeline, loss=trainer.training_step, ...)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ddpkit.errors import ConfigError
from ddpkit.training.optim import OptimizerStep
from ddpkit.training.pipeline_step import Pipeline, PipelineStep
from ddpkit.training.train_step import AccumulationStep, StepReporting, TrainStep

__all__ = ["build_train_step", "refuse_training_step_override"]


def build_train_step(
    update: OptimizerStep,
    model: nn.Module,
    pipeline: Pipeline | None,
    *,
    loss: Callable[[Any], Any],
    owner: type,
    reporting: StepReporting,
    device: torch.device,
    accum: int,
) -> TrainStep:
    """The pipeline's step when there is one, else accumulation over ``accum`` micro-batches of ``model``."""
    if pipeline is not None:
        return PipelineStep(pipeline, update=update, reporting=reporting, device=device)
    return AccumulationStep(update, model, loss=loss, owner=owner, reporting=reporting, device=device, accum=accum)


def refuse_training_step_override(trainer_class: type, base: type) -> None:
    """Under a pipeline no rank holds the whole model, so ``training_step`` cannot run: a subclass overriding it
    is told which method to override instead."""
    if trainer_class.training_step is not base.training_step:
        raise ConfigError(
            f"parallel.pipeline > 1: {trainer_class.__name__} overrides training_step, which needs the whole model; "
            "under a pipeline the loss runs on the last stage: override pipeline_loss(output, target) instead "
            "(and pipeline_stages(model, stages) for a model ddpkit cannot cut), or set parallel.pipeline=1"
        )
