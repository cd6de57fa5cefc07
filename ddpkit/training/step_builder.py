"""Which step object a run trains with: accumulation, or a pipeline schedule (``parallel.pipeline > 1``).

step = build_train_step(update, models.train, pipeline, loss=trainer.training_step, ...)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ddpkit.errors import ConfigError
from ddpkit.parallel.data_parallel import DataParallel
from ddpkit.parallel.pipeline import Pipeline
from ddpkit.training.optim import OptimizerStep
from ddpkit.training.pipeline_step import PipelineStep
from ddpkit.training.train_step import AccumulationStep, StepReporting, TrainStep

__all__ = ["build_train_step", "refuse_training_step_override", "LossParallelStep"]


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
    vocab_parallel: bool = False,
    data_parallel: DataParallel | None = None,
) -> TrainStep:
    """The pipeline's step when there is one, else accumulation over ``accum`` micro-batches of ``model``;
    ``vocab_parallel``: that step under torch's ``loss_parallel()`` (:class:`LossParallelStep`)."""
    if pipeline is not None:
        step: TrainStep = PipelineStep(pipeline, update=update, reporting=reporting, device=device)
    else:
        step = AccumulationStep(
            update,
            model,
            loss=loss,
            owner=owner,
            reporting=reporting,
            device=device,
            accum=accum,
            data_parallel=data_parallel,
        )
    return LossParallelStep(step) if vocab_parallel else step


class LossParallelStep:
    """A step whose losses and backwards run under torch's ``loss_parallel()`` (``parallel.vocab_parallel``).

    The tensor plan then leaves the logits sharded by vocabulary (each rank scores its own ids), and
    ``loss_parallel`` is what lets ``F.cross_entropy`` read them so, in the forward and in the backward: the
    context must hold across both, so it holds across the whole step (torchtitan's ``train_context``).
    """

    def __init__(self, inner: TrainStep):
        self.inner = inner
        self.batches_per_step = inner.batches_per_step
        self.takes_short_steps = inner.takes_short_steps

    def run(self, batches: Iterator[Any], *, count: int) -> int:
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            return self.inner.run(batches, count=count)


def refuse_training_step_override(trainer_class: type, base: type) -> None:
    """Under a pipeline no rank holds the whole model, so ``training_step`` cannot run: a subclass overriding it
    is told which method to override instead."""
    if trainer_class.training_step is not base.training_step:
        raise ConfigError(
            f"parallel.pipeline > 1: {trainer_class.__name__} overrides training_step, which needs the whole model; "
            "under a pipeline the loss runs on the last stage: override pipeline_loss(output, target) instead "
            "(and pipeline_stages(model, stages) for a model ddpkit cannot cut), or set parallel.pipeline=1"
        )
