"""A Trainer that timestamps every optimizer step, and the overrides that make a run a clean benchmark.

    trainer = TimedTrainer(config, overrides=benchmark_overrides(out_dir, steps=30))
    trainer.fit()
    ms = steady_ms_per_step(trainer.step_times, warmup=5)

Timing uses the Trainer's public hooks only (``on_fit_start``, ``on_step_end``), so what is
measured is exactly the loop users run. A step's time is the gap between consecutive
``on_step_end`` calls: data, forward, backward with the gradient allreduce, optimizer, and the
loop's own bookkeeping. The first ``warmup`` steps (allocator growth, DDP's bucket rebuild after
the first iteration) are left out.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ddpkit.trainer import Trainer

__all__ = ["TimedTrainer", "benchmark_overrides", "steady_ms_per_step"]


class TimedTrainer(Trainer):
    """``Trainer`` recording ``time.perf_counter()`` at the start and after every optimizer step."""

    step_times: list[float]

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # Benchmark output is the benchmark's table and progress, not each run's INFO lines.
        logging.getLogger("ddpkit").addFilter(_warnings_and_up)  # added once, however many runs
        self.step_times = []

    def on_fit_start(self) -> None:
        self.step_times = [time.perf_counter()]

    def on_step_end(self, step: int) -> None:
        self.step_times.append(time.perf_counter())


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


def steady_ms_per_step(step_times: Sequence[float], *, warmup: int) -> float:
    """Mean milliseconds per step after the first ``warmup`` steps (total time / steps, not a median).

    A mean over the window keeps periodic costs (a loss reduction every ``log_every`` steps) in
    the number; medians are taken across repeated runs instead.
    """
    steps = len(step_times) - 1
    if steps <= warmup:
        raise ValueError(f"{steps} timed steps, but {warmup} are warm-up: run more steps than warm-up steps")
    return (step_times[-1] - step_times[warmup]) / (steps - warmup) * 1000
