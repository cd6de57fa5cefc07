"""A pipeline schedule as the Trainer's step object: M microbatches through P stages, then the update.

    pipeline = build_pipeline(model, layout, cfg, runtime, ...)   # every rank (ddpkit.parallel.pipeline)
    step = PipelineStep(pipeline, update=optimizer_step, reporting=reporting, device=device)
    step.run(batches, count=M)      # the schedule runs every forward and backward; then clip, step, zero

The schedule (torch's, built by :mod:`ddpkit.parallel.pipeline`) gets the microbatches the data-parallel
accumulation would have used (pre-split, so no chunking rule of the schedule changes a sample), and the step runs the
same update as every other step.

Exact like accumulation: with ``loss_normalization: mean`` the loss is each microbatch's mean and the schedule
divides the gradients by M (``scale_grads``), as accumulation divides each loss by M; under ``tokens`` the loss is a
sum, the schedule does not scale, and the token count, taken from the targets of the batch before the forward and
summed over the data-parallel group (not over the stages: every stage of a pipeline sees the same batch), decides
the factor. torchtitan#2972 multiplies the gradients by the token count once too often; here the count is applied
once, in :class:`ddpkit.training.token_loss.TokenCount`.

Health sees the pipeline as it sees accumulation: the last stage's loss function is poisoned by
:func:`ddpkit.training.health_checks.watched` (a non-finite loss makes every gradient NaN, on every stage and
replica), and the step hands the schedule's losses to ``health.record`` before the update, so a NaN's report names
the step, the rank and its samples, and the spike detector reads the real loss.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch

from ddpkit.data.tokens import IGNORE_INDEX
from ddpkit.parallel.pipeline import Pipeline
from ddpkit.training.train_step import StepReporting

__all__ = ["PipelineStep"]


class PipelineStep:
    """One optimizer step: the schedule over M microbatches, the tied gradients summed, then the shared update."""

    takes_short_steps = False

    def __init__(self, pipeline: Pipeline, *, update: Any, reporting: StepReporting, device: torch.device):
        self.pipeline = pipeline
        self.update = update
        self.reporting = reporting
        self.device = device
        self.batches_per_step = pipeline.microbatches
        self._zero = torch.zeros((), device=device)

    def run(self, batches: Iterator[Any], *, count: int) -> int:
        """Take ``count`` (= M) microbatches, run the schedule and the update; return how many were taken."""
        from ddpkit.data import move_to_device

        microbatches = [move_to_device(batch, self.device) for batch in batches]
        if len(microbatches) < self.batches_per_step:
            return len(microbatches)
        pipeline = self.pipeline
        reporter = self.reporting.reporter
        targets = [batch[1] for batch in microbatches]
        tokens = self.update.tokens
        if tokens is not None:
            tokens.add(sum((target != IGNORE_INDEX).sum() for target in targets))
        kwargs: dict[str, Any] = {"return_outputs": False}
        if pipeline.first:
            kwargs["arg_mbs"] = [(batch[0],) for batch in microbatches]
        if pipeline.takes_tokens:
            # The document mask: every stage finds the documents in the token ids, which every rank of the pipeline
            # holds (each reads the same batch), beside the activations it receives.
            kwargs["kwarg_mbs"] = [{"tokens": batch[0]} for batch in microbatches]
        losses: list[torch.Tensor] = []
        if pipeline.last:
            kwargs["target_mbs"] = targets
            kwargs["losses"] = losses
        # Forwards and backwards interleave under 1F1B: one span for the schedule's whole run.
        began = time.time_ns()
        with reporter.span("forward"), self.update.autocast():
            pipeline.schedule.step(**kwargs)
        span = (time.time_ns() - began) / 1e9
        busy, spans = pipeline.clock.take()
        reporter.add_stage_time(stage=pipeline.stage, busy=busy, span=span, theory=pipeline.theory, spans=spans)
        self._report(losses, targets)
        if self.update.health is not None:
            # The last stage's losses (none elsewhere): what a non-finite step's report names, what spikes are read from
            self.update.health.record(losses)
        pipeline.tied.reduce()
        self.reporting.update(self.update)
        return len(microbatches)

    def _report(self, losses: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
        reporter = self.reporting.reporter
        by_tokens = self.update.tokens is not None
        if not losses:
            # Not the last stage: a zero of weight zero keeps every rank's running mean in step.
            reporter.add_loss(self._zero, self._zero)
            return
        for loss, target in zip(losses, targets):
            reporter.add_loss(loss, (target != IGNORE_INDEX).sum() if by_tokens else torch.ones((), device=self.device))
