"""The ``train.profile`` config section: a torch.profiler trace per rank, on torch.profiler's schedule.

    train:
      profile: {wait: 1, warmup: 1, active: 3, repeat: 1}   # null (the default): no profiler at all

Behaviour lives in :mod:`ddpkit.reporting.profiler`; docs/profiling.md says how to open the traces.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddpkit.config.fields import option

__all__ = ["ProfileConfig"]


@dataclass(frozen=True)
class ProfileConfig:
    """torch.profiler's schedule, counted in optimizer steps: skip `wait`, warm up for `warmup`, record `active`,
    `repeat` times."""

    wait: int = option(1, "Optimizer steps skipped at the start of each cycle (not recorded).", ge=0)
    warmup: int = option(
        1, "Steps the profiler runs but discards after `wait`, so the recorded steps do not pay its start-up.", ge=0
    )
    active: int = option(
        3, "Steps recorded per cycle: one trace file per rank and cycle, written when the cycle ends.", ge=1
    )
    repeat: int = option(
        1,
        "Cycles of wait + warmup + active. `0`: cycles until training ends (a trace file per cycle; mind the disk).",
        ge=0,
    )
