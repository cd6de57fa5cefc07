"""The Trainer's step object: one optimizer step of the batches it asks for, behind one interface.

    step = AccumulationStep(update, models, loss=trainer.training_step, reporting=..., accum=k)
    taken = step.run(batches, count=step.batches_per_step)    # forward + backward of each, then the update

detectron2's ``run_step`` and torchtitan's ``train_step`` are the models: the loop asks for "one optimizer step
of these batches" and does not know how the micro-batches run. Two implementations:

- :class:`AccumulationStep` (here): data parallelism's gradient accumulation, ``k`` micro-batches, the first
  ``k - 1`` under DDP's ``no_sync()``, each loss from ``training_step``; then the update.
- :class:`ddpkit.training.pipeline_step.PipelineStep`: a pipeline schedule runs the M microbatches' forwards and
  backwards over the stages; then the same update.

The update itself (token scaling, clipping, optimizer, schedule, zero) is :class:`ddpkit.training.optim.OptimizerStep`.
``batches_per_step`` says how many batches a step takes; ``takes_short_steps`` whether an epoch's last step may
take fewer (accumulation may; a pipeline schedule needs exactly M, so an epoch's shorter tail is skipped).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from torch import nn

from ddpkit.parallel.data_parallel import DDP, DataParallel
from ddpkit.progress import Progress
from ddpkit.training.optim import OptimizerStep

__all__ = ["TrainStep", "AccumulationStep", "StepReporting"]


@dataclass(frozen=True)
class StepReporting:
    """What a step object tells the run: spans and losses (the reporter), the update's start (the events), at which
    step (the progress)."""

    reporter: Any
    events: Any
    progress: Progress

    def update(self, update: OptimizerStep) -> None:
        """Every step object's end: the events hear the update start, then the update runs in the "optimizer" span."""
        self.events.update_start(self.progress.step)
        with self.reporter.span("optimizer"):
            update.step()


class TrainStep(Protocol):
    """What the loop asks of a step object."""

    batches_per_step: int
    takes_short_steps: bool

    def run(self, batches: Iterator[Any], *, count: int) -> int: ...


class AccumulationStep:
    """``count`` micro-batches forward and backward (gradients synchronised on the last), then the update."""

    takes_short_steps = True

    def __init__(
        self,
        update: OptimizerStep,
        model: nn.Module,
        *,
        loss: Callable[[Any], Any],
        owner: type,
        reporting: StepReporting,
        device: Any,
        accum: int,
        data_parallel: DataParallel | None = None,
    ):
        self.update = update
        self.model = model
        #: How the replicas hold parameters: what skips the gradients' reduction on all micro-batches but the last.
        self.data_parallel = data_parallel if data_parallel is not None else DDP()
        self.loss = loss
        self.owner = owner
        self.reporting = reporting
        self.device = device
        self.batches_per_step = accum

    def run(self, batches: Iterator[Any], *, count: int) -> int:
        """Forward and backward each of up to ``count`` batches; the update once all ``count`` came.

        Returns how many batches it took: fewer than ``count`` when a stream ended (no update then).
        """
        from ddpkit.data import move_to_device

        taken = 0
        for batch in batches:
            taken += 1
            self._micro_step(move_to_device(batch, self.device), sync=taken == count)
        if taken < count:
            return taken
        self.reporting.update(self.update)
        return taken

    def _micro_step(self, batch: Any, *, sync: bool) -> None:
        reporter = self.reporting.reporter
        update = self.update
        with self.data_parallel.sync_gradients(self.model, sync=sync):
            with reporter.span("forward"), update.autocast():
                loss, tokens = update.loss_of(self.loss(batch), owner=self.owner)
            reporter.add_loss(loss, tokens)
            with reporter.span("backward"):
                update.backward(loss, tokens)
