"""``checkpoint.every_steps: auto``: how many optimizer steps between two periodic checkpoints, by Young/Daly.

    checkpoint:
      every_steps: auto             # ddpkit run exp.yaml --max-restarts 3
      mtbf_hours: 24                # the failures this job expects: about one a day

    interval = AutoInterval(mtbf_hours=24.0)        # the Checkpointer holds one when every_steps is auto
    interval.tick()                                 # each optimizer step, every rank: one clock read
    interval.due(steps_since_save)                  # the same answer on every rank
    interval.saved(blocked=seconds, since=step)     # after each save, every rank: one broadcast

Saving every T seconds of training costs ``T_save / T`` of the time, and a failure loses on
average ``T / 2`` of work, i.e. ``T / (2 * MTBF)`` of the time; the sum is least at
``T = sqrt(2 * MTBF * T_save)`` (Young 1974; Daly 2006). ``T_save`` is the measured blocking
time of the latest save (with ``checkpoint.async`` only the copy to CPU memory blocks); T becomes
steps with the median wall time of the last :data:`WINDOW` optimizer steps (steps that include a
save are left out): ``steps = max(1, round(T / step_seconds))``.

Until a save has been timed, the interval is :data:`FIRST_EVERY` steps: the first periodic save
(or any earlier one, e.g. a best checkpoint) is the measurement. Every save re-estimates; a new
interval replaces the current one only when it differs by more than :data:`CHANGE`, so the log
line, written when the interval is picked and each time it changes, is always the one in force::

    checkpoint.every_steps=auto: every 340 steps from step 100 (a save blocks 210 ms, a step takes
    12.3 ms, checkpoint.mtbf_hours=24: Young/Daly sqrt(2*MTBF*T_save) = 3.2 min)

A save is a collective (rank 0 writes, every rank waits), so every rank must pick the same
steps: rank 0's measurements decide and are broadcast, once per save, never per step.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque

from ddpkit.distributed.collectives import broadcast_object
from ddpkit.reporting.log import log

__all__ = ["AutoInterval", "young_daly_seconds", "interval_steps", "describe", "FIRST_EVERY"]

FIRST_EVERY = 100  # steps to the first periodic save, the one that times T_save (unless a save came earlier)
WINDOW = 256  # optimizer-step times kept for the median
CHANGE = 0.2  # a re-estimate replaces the interval only when it differs by more than this fraction


def young_daly_seconds(mtbf_hours: float, save_seconds: float) -> float:
    """``sqrt(2 * MTBF * T_save)`` in seconds: the checkpoint period wasting least time to saves and failures."""
    return math.sqrt(2.0 * mtbf_hours * 3600.0 * save_seconds)


def interval_steps(interval_seconds: float, step_seconds: float) -> int:
    """``interval_seconds`` as a whole number of optimizer steps of ``step_seconds`` each, at least 1."""
    if step_seconds <= 0:
        raise ValueError(f"a step takes a positive time, got {step_seconds!r} s")
    return max(1, round(interval_seconds / step_seconds))


def _duration(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1e3:.3g} ms"
    if seconds < 120:
        return f"{seconds:.3g} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def describe(every: int, *, since: int, save_seconds: float, step_seconds: float, mtbf_hours: float) -> str:
    """The log line of a choice: the interval and every input that made it."""
    period = young_daly_seconds(mtbf_hours, save_seconds)
    return (
        f"checkpoint.every_steps=auto: every {every} steps from step {since} (a save blocks {_duration(save_seconds)}, "
        f"a step takes {_duration(step_seconds)}, checkpoint.mtbf_hours={mtbf_hours:g}: "
        f"Young/Daly sqrt(2*MTBF*T_save) = {_duration(period)})"
    )


class AutoInterval:
    """The steps between two periodic saves under ``checkpoint.every_steps: auto`` (see the module docstring)."""

    def __init__(self, mtbf_hours: float):
        self.mtbf_hours, self.every, self.measured = mtbf_hours, FIRST_EVERY, False
        self._step_times: deque[float] = deque(maxlen=WINDOW)
        self._last_tick: float | None = None

    def tick(self) -> None:
        """An optimizer step ended (every step, every rank): one clock read, no collective."""
        now = time.perf_counter()
        if self._last_tick is not None:
            self._step_times.append(now - self._last_tick)
        self._last_tick = now

    def due(self, steps_since_save: int) -> bool:
        """Whether a periodic save is due ``steps_since_save`` steps after the previous one."""
        return steps_since_save >= self.every

    def saved(self, *, blocked: float, since: int) -> None:
        """After a save that blocked ``blocked`` seconds (every rank, like the save): re-estimate.

        ``since`` is the step the interval counts from (the latest periodic save), for the log line.
        Rank 0's measurements are broadcast, so every rank holds the same interval (a save that
        already broadcasts its outcome carries them instead: :meth:`measurement`, :meth:`adopt`)."""
        self.adopt(broadcast_object(self.measurement(blocked)), since=since)

    def measurement(self, blocked: float) -> tuple[float, float] | None:
        """This rank's ``(save seconds, median step seconds)``, None before a step was timed; the next step
        (the one that carries this save) is not a step time."""
        mine = (blocked, statistics.median(self._step_times)) if self._step_times else None
        self._last_tick = None
        return mine

    def adopt(self, measured: tuple[float, float] | None, *, since: int) -> None:
        """Re-estimate from rank 0's :meth:`measurement` (the same on every rank; no collective)."""
        if measured is None:  # no step timed yet (a save at the first step): keep the current interval
            return
        save_seconds, step_seconds = measured
        every = interval_steps(young_daly_seconds(self.mtbf_hours, save_seconds), step_seconds)
        if self.measured and abs(every - self.every) <= CHANGE * self.every:
            return
        self.every, self.measured = every, True
        log.info(
            describe(
                every, since=since, save_seconds=save_seconds, step_seconds=step_seconds, mtbf_hours=self.mtbf_hours
            )
        )
