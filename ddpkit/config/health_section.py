"""The ``health`` config section: what the loop does about NaNs, loss spikes, slow ranks and diverged replicas.

    health:
      nonfinite: skip            # or stop
      max_skips: 10
      spike: {sigma: 6, window: 128, warmup: 20, action: warn}   # null (the default): off
      straggler: {every: 20, margin: 0.25, windows: 2}           # null: off
      check_replicas_every: 100                                  # null: off
      on_divergence: broadcast                                   # or stop

Behaviour lives in :mod:`ddpkit.training.health`; docs/health.md says what each check costs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ddpkit.config.fields import option

__all__ = ["HealthConfig", "SpikeConfig", "StragglerConfig"]


@dataclass(frozen=True)
class SpikeConfig:
    """Loss-spike detection: a loss or gradient norm far above its rolling window."""

    sigma: float = option(
        6.0,
        "A step is a spike when its loss or gradient norm is more than "
        "this many standard deviations above the window's mean.",
        gt=0,
    )
    window: int = option(128, "Steps in the rolling window (finite, non-spike steps only).", ge=2)
    warmup: int = option(20, "Steps recorded before any step can count as a spike.", ge=2)
    action: Literal["warn", "skip", "rollback"] = option(
        "warn",
        "`warn`: log it; `skip`: drop that step's update on every "
        "rank; `rollback`: restore the newest valid checkpoint's "
        "weights and optimizer and go on with the next batches (the data is not rewound), or skip when there is none.",
    )


@dataclass(frozen=True)
class StragglerConfig:
    """Slow-rank detection from each rank's own work per step (data, forward, backward until its last gradient)."""

    every: int = option(50, "Optimizer steps per comparison window (one small all_reduce per window).", ge=2)
    margin: float = option(
        0.25,
        "A rank is slow when its median own-work time per step exceeds the other ranks' median by this fraction.",
        gt=0,
    )
    windows: int = option(
        2, "Consecutive slow windows before the rank is named (filters out a noisy machine's bursts).", ge=1
    )


@dataclass(frozen=True)
class HealthConfig:
    """Training health: non-finite steps, loss spikes, stragglers and replica divergence, decided by all ranks
    together."""

    nonfinite: Literal["skip", "stop"] = option(
        "skip",
        "A non-finite loss or gradient on any rank: `skip` the optimizer and scheduler step on every rank, or `stop` "
        "the run at once (non-zero exit). The log names the step, the rank(s) and the batch's sample indices.",
    )
    max_skips: int = option(
        10, "Consecutive skipped steps (non-finite or spike) after which the run stops with an error.", ge=1
    )
    spike: SpikeConfig | None = option(
        None,
        "Loss-spike detection (`{sigma, window, warmup, action}`); "
        "`null`: off (it costs one small all_reduce per step).",
    )
    straggler: StragglerConfig | None = option(factory=StragglerConfig, doc="Straggler detection; `null`: off.")
    check_replicas_every: int | None = option(
        500,
        "Optimizer steps between comparisons of an exact fingerprint of every rank's parameters; `null`: off.",
        ge=1,
    )
    on_divergence: Literal["stop", "broadcast"] = option(
        "broadcast",
        "When a rank's parameters differ from rank 0's: `broadcast` rank 0's weights to every rank, or `stop` the run.",
    )
