"""A Trainer that timestamps every optimizer step, and the overrides that make a run a clean benchmark.

    trainer = TimedTrainer(config, overrides=benchmark_overrides(out_dir, steps=30))
    trainer.fit()
    ms = steady_ms_per_step(trainer.clock.wall, warmup=5)       # wall-clock ms per step
    cpu = steady_ms_per_step(trainer.clock.cpu, warmup=5)       # CPU ms of the training thread

Timing uses the Trainer's public hooks only (``on_fit_start``, ``on_step_end``), so what is
measured is exactly the loop users run. A step's time is the gap between consecutive
``on_step_end`` calls: data, forward, backward with the gradient allreduce, optimizer, and the
loop's own bookkeeping. The first ``warmup`` steps (allocator growth, DDP's bucket rebuild after
the first iteration) are left out.

Two clocks: wall time is what a user waits for; the training thread's CPU time
(``time.thread_time``) leaves out the time this process spent descheduled or blocked (waiting
for the other ranks, or for other jobs on a shared machine), so it shows a loop's own Python
overhead with much less noise.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ddpkit.trainer import Trainer

__all__ = ["StepClock", "TimedTrainer", "benchmark_overrides", "steady_ms_per_step", "median_step_ms"]


class StepClock:
    """Wall-clock and thread-CPU timestamps, one pair per :meth:`tick`."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def tick(self) -> None:
        self.wall.append(time.perf_counter())
        self.cpu.append(time.thread_time())


class TimedTrainer(Trainer):
    """``Trainer`` ticking a :class:`StepClock` at the start and after every optimizer step."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # Benchmark output is the benchmark's table and progress, not each run's INFO lines; logging adds the
        # filter once, however many runs.
        logging.getLogger("ddpkit").addFilter(_warnings_and_up)
        self.clock = StepClock()

    @property
    def step_times(self) -> list[float]:
        """Wall-clock timestamps: the start, then one after each optimizer step."""
        return self.clock.wall

    def on_fit_start(self) -> None:
        self.clock = StepClock()
        self.clock.tick()

    def on_step_end(self, step: int) -> None:
        self.clock.tick()


def _warnings_and_up(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING


def benchmark_overrides(output_dir: str | Path, *, steps: int) -> list[str]:
    """Overrides for a fixed-length run with nothing but training steps inside the timed window.

    Exactly ``steps`` optimizer steps (epochs are unbounded), no checkpoints, no resume from an
    earlier run, no validation until the loop has ended (``eval_every`` beyond the last step),
    no progress bar, no timeline, no TensorBoard, and a private output directory.
    """
    return [
        f"run.output_dir={output_dir}",
        f"train.max_steps={steps}",
        "train.epochs=null",
        f"train.eval_every={steps + 1_000_000}",
        "train.early_stopping.metric=null",
        "train.timeline=false",
        "checkpoint.every_epochs=null",
        "checkpoint.every_steps=null",
        "checkpoint.best=null",
        "checkpoint.resume=none",
        "log.progress_bar=false",
        "log.tensorboard=false",
    ]


def steady_ms_per_step(stamps: Sequence[float], *, warmup: int) -> float:
    """Mean milliseconds per step after the first ``warmup`` steps (total time / steps, not a median).

    A mean over the window keeps periodic costs (a loss reduction every ``log_every`` steps) in
    the number; medians are taken across repeated runs instead.
    """
    steps = len(stamps) - 1
    if steps <= warmup:
        raise ValueError(f"{steps} timed steps, but {warmup} are warm-up: run more steps than warm-up steps")
    return (stamps[-1] - stamps[warmup]) / (steps - warmup) * 1000


def median_step_ms(stamps: Sequence[float], *, warmup: int) -> float:
    """Median milliseconds of the single steps after the warm-up: robust to bursts of other work."""
    gaps = [b - a for a, b in zip(stamps[warmup:], stamps[warmup + 1 :])]
    if not gaps:
        raise ValueError("no timed steps after the warm-up")
    return statistics.median(gaps) * 1000
