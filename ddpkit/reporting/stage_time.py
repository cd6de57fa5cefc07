"""Each pipeline stage's busy and idle time inside the schedule, for the training records.

    times = StageTimes()
    times.add(stage=1, busy=0.031, span=0.042, theory=0.2)   # every step (ddpkit.training.pipeline_step)
    times.fields()    # at a record (a collective): {"stage0_busy_s": ..., "stage0_idle": ..., "bubble_theory": 0.2}

A stage's *busy* seconds are its compute inside torch's schedule (the forwards, the loss, the backwards with their
gradient reduction); its *span* is the time this rank spent in ``schedule.step``; ``idle = 1 - busy / span`` is the
share of that span it waited (for activations or gradients from its neighbours, and in torch's point-to-point
calls): the measured bubble, beside the theory's ``(P - 1) / (M + P - 1)``. Each field is the mean over the
steps since the last record and over the stage's data-parallel replicas (all ranks' values are gathered, so every
rank writes the same record).
"""

from __future__ import annotations

from ddpkit.distributed.collectives import all_gather_object

__all__ = ["StageTimes"]


class StageTimes:
    """This rank's stage times since the last record; :meth:`fields` gathers every rank's."""

    def __init__(self) -> None:
        self.stage: int | None = None
        self.busy = 0.0
        self.span = 0.0
        self.steps = 0
        self.theory: float | None = None

    def add(self, *, stage: int, busy: float, span: float, theory: float | None) -> None:
        """One optimizer step of stage ``stage``: ``busy`` seconds of compute in a schedule of ``span`` seconds."""
        self.stage = stage
        self.busy += busy
        self.span += span
        self.steps += 1
        self.theory = theory

    def fields(self) -> dict[str, float]:
        """The record's fields, the same on every rank (a collective when any step was added; every rank of a
        pipeline adds one each step, so all of them gather together); {} without a pipeline."""
        if self.stage is None:
            return {}
        mine = (self.stage, self.busy, self.span, self.steps)
        self.busy = 0.0
        self.span = 0.0
        self.steps = 0
        totals: dict[int, list[float]] = {}
        for stage, busy, span, steps in all_gather_object(mine):
            entry = totals.setdefault(stage, [0.0, 0.0, 0])
            entry[0] += busy
            entry[1] += span
            entry[2] += steps
        fields: dict[str, float] = {}
        for stage in sorted(totals):
            busy, span, steps = totals[stage]
            fields[f"stage{stage}_busy_s"] = busy / max(steps, 1)
            fields[f"stage{stage}_idle"] = 1.0 - busy / span if span > 0 else float("nan")
        if self.theory is not None:
            fields["bubble_theory"] = self.theory
        return fields
