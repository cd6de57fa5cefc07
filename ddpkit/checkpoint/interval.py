"""``checkpoint.every_steps: auto``: how many optimizer steps between two periodic checkpoints, by Young/Daly.

    checkpoint:
      every_steps: auto             # ddpkit run exp.yaml --max-restarts 3
      mtbf_hours: 24                # the failures this job expects: about one a day

    interval = AutoInterval(mtbf_hours=24.0)        # the Checkpointer holds one when every_steps is auto
    interval.tick()                                 # each optimizer step, every rank: one clock read
    interval.due(steps_since_save)                  # the same answer on every rank
    measured = interval.measurement(blocked)        # after each save, rank 0's rides on the save's broadcast
    interval.adopt(measured, since=step)            # every rank, the same measurement: the same interval

    plan = YoungDaly(mtbf_hours=24.0, every=100)    # the planner itself, also the memory snapshots'
    plan.update(blocked=0.21, step_seconds=0.0123)  # True when plan.every changed

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
:class:`YoungDaly` is the planner, shared with the memory snapshots (:mod:`ddpkit.checkpoint.memory_tier`),
which space their copies the same way from their own blocking time.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque

from ddpkit.reporting.log import log

__all__ = ["AutoInterval", "YoungDaly", "young_daly_seconds", "interval_steps", "describe", "FIRST_EVERY"]

#: Steps to the first periodic save, the one that times T_save (unless a save came earlier).
FIRST_EVERY = 100
#: Optimizer-step times kept for the median.
WINDOW = 256
#: A re-estimate replaces the interval only when it differs by more than this fraction.
CHANGE = 0.2


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


class YoungDaly:
    """The steps between two saves that waste the least time to saves and failures, re-planned from each
    measurement: every ``sqrt(2 * MTBF * T_block)`` seconds of training (Young 1974; Daly 2006), ``T_block``
    being how long one save blocks training, as whole steps of ``step_seconds``.

    ``every`` is the first guess until a measurement is planned; a later plan replaces the one in force only
    when it differs by more than :data:`CHANGE` of it, so a logged interval is the one that holds. ``budget``
    (a fraction) also keeps the saves from blocking more than that share of the time, whatever the MTBF.
    Fed the same measurement on every rank, every rank holds the same interval without a collective.
    """

    def __init__(self, mtbf_hours: float, *, every: int, budget: float | None = None):
        self.mtbf_hours = mtbf_hours
        #: Steps between two saves: the first guess, then the plan in force.
        self.every = every
        #: Whether a measurement has been planned (before it, any plan is taken).
        self.planned = False
        self.budget = budget

    def period(self, blocked: float) -> float:
        """Young/Daly's period in seconds for saves that block ``blocked`` seconds (the budget left out)."""
        return young_daly_seconds(self.mtbf_hours, blocked)

    def update(self, *, blocked: float, step_seconds: float) -> bool:
        """Plan from a save that blocked ``blocked`` seconds and steps of ``step_seconds``; whether ``every``
        changed (the caller logs the choice)."""
        seconds = self.period(blocked)
        if self.budget is not None:
            seconds = max(seconds, blocked / self.budget)
        every = interval_steps(seconds, step_seconds)
        if self.planned and abs(every - self.every) <= CHANGE * self.every:
            return False
        self.every = every
        self.planned = True
        return True


class AutoInterval:
    """The steps between two periodic saves under ``checkpoint.every_steps: auto`` (see the module docstring)."""

    def __init__(self, mtbf_hours: float):
        self.mtbf_hours = mtbf_hours
        self._plan = YoungDaly(mtbf_hours, every=FIRST_EVERY)
        self._step_times: deque[float] = deque(maxlen=WINDOW)
        self._last_tick: float | None = None

    @property
    def every(self) -> int:
        """Steps between two periodic saves: :data:`FIRST_EVERY` until a save was measured."""
        return self._plan.every

    @property
    def measured(self) -> bool:
        """Whether a save's measurement has set :attr:`every`."""
        return self._plan.planned

    def tick(self) -> None:
        """An optimizer step ended (every step, every rank): one clock read, no collective."""
        now = time.perf_counter()
        if self._last_tick is not None:
            self._step_times.append(now - self._last_tick)
        self._last_tick = now

    def due(self, steps_since_save: int) -> bool:
        """Whether a periodic save is due ``steps_since_save`` steps after the previous one."""
        return steps_since_save >= self.every

    def measurement(self, blocked: float) -> tuple[float, float] | None:
        """This rank's ``(save seconds, median step seconds)`` after a save that blocked ``blocked`` seconds, None
        before a step was timed; the next step (the one that carries this save) is not a step time. Rank 0's is
        what every rank adopts: the save broadcasts it with its own outcome."""
        mine = (blocked, statistics.median(self._step_times)) if self._step_times else None
        self._last_tick = None
        return mine

    def adopt(self, measured: tuple[float, float] | None, *, since: int) -> None:
        """Re-estimate from rank 0's :meth:`measurement` (the same on every rank; no collective); ``since`` is the
        step the interval counts from (the latest periodic save), for the log line."""
        # No step timed yet (a save at the first step): keep the current interval.
        if measured is None:
            return
        save_seconds, step_seconds = measured
        if self._plan.update(blocked=save_seconds, step_seconds=step_seconds):
            line = describe(
                self.every,
                since=since,
                save_seconds=save_seconds,
                step_seconds=step_seconds,
                mtbf_hours=self.mtbf_hours,
            )
            log.info(line)
