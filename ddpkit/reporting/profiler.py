"""``train.profile``: a torch.profiler trace per rank, with ddpkit's phases labelled, as a loop listener.

    profiler = Profiler.for_run(config, rank=0, device=torch.device("cpu"))   # None when train.profile is null
    events.add(profiler)          # on_fit_start: start; on_phase: record_function; on_step_end: prof.step()
    # traces: <output_dir>/profile/rank<R>.<ns>.pt.trace.json, one per rank and recorded cycle

The schedule is torch.profiler's own (``wait``, ``warmup``, ``active``, ``repeat``, counted in
optimizer steps), so a trace holds ``ProfilerStep#N`` spans and, inside them, the loop's phases as
``record_function`` ranges named ``ddpkit.data``, ``ddpkit.forward``, ``ddpkit.backward``,
``ddpkit.optimizer``, ... around torch's own operators. CPU activity is always recorded, CUDA
activity when the run trains on a CUDA device. Files are written in the Chrome trace format of
``torch.profiler.tensorboard_trace_handler`` (open them in https://ui.perfetto.dev, chrome://tracing
or TensorBoard's profiler plugin: docs/profiling.md), each atomically.

Zero cost when ``train.profile`` is null: no listener is added. Once the schedule's last cycle is
written (``repeat`` > 0) the profiler stops and ``on_phase`` returns at once.
"""

from __future__ import annotations

import os
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from ddpkit.atomic import temporary_path
from ddpkit.config.schema import Config

__all__ = ["Profiler", "PROFILE_DIR", "PHASE_PREFIX"]

#: Where the traces go, under the run's output directory.
PROFILE_DIR = "profile"
#: The prefix of the loop's phase names in a trace (``ddpkit.forward``).
PHASE_PREFIX = "ddpkit."


class Profiler:
    """One rank's torch.profiler over a run: a listener of :class:`ddpkit.reporting.events.Events`."""

    def __init__(
        self,
        *,
        wait: int,
        warmup: int,
        active: int,
        repeat: int,
        trace_dir: str | os.PathLike,
        rank: int,
        cuda: bool = False,
    ):
        self.trace_dir = Path(trace_dir)
        self.rank = rank
        # Steps until the last cycle is written; 0: never ends
        self._total = (wait + warmup + active) * repeat
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self._prof = profile(
            activities=activities,
            schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=repeat),
            on_trace_ready=self._write,
            record_shapes=False,
        )
        self._ranges: list[AbstractContextManager[Any]] = []
        self._steps = 0
        self._running = False
        #: The trace files written so far.
        self.traces: list[Path] = []

    @classmethod
    def for_run(cls, config: Config, *, rank: int, device: torch.device) -> Profiler | None:
        """The profiler ``config.train.profile`` asks for, or None when it is null."""
        section = config.train.profile
        if section is None:
            return None
        return cls(
            wait=section.wait,
            warmup=section.warmup,
            active=section.active,
            repeat=section.repeat,
            trace_dir=Path(config.output_dir) / PROFILE_DIR,
            rank=rank,
            cuda=device.type == "cuda",
        )

    # --- listener methods (ddpkit.reporting.events) ---------------------------------------------

    def on_fit_start(self) -> None:
        """Start profiling: the first optimizer step is step 0 of the schedule."""
        if not self._running and not self._done():
            self._prof.start()
            self._running = True

    def on_phase(self, name: str | None) -> None:
        """A span of the loop starts (its name) or ends (None): a ``record_function`` range while profiling."""
        if not self._running:
            return
        if name is not None:
            scope = record_function(PHASE_PREFIX + name)
            scope.__enter__()
            self._ranges.append(scope)
        elif self._ranges:
            self._ranges.pop().__exit__(None, None, None)

    def on_step_end(self, step: int) -> None:
        """One optimizer step done: the schedule advances (``prof.step()``); after the last cycle, stop."""
        if not self._running:
            return
        self._prof.step()
        self._steps += 1
        if self._done():
            self.stop()

    def on_exit(self, status: str) -> None:
        """The attempt ended (any way): close open ranges and stop; a cycle being recorded is written."""
        self.stop()

    def stop(self) -> None:
        """Stop profiling (idempotent)."""
        while self._ranges:
            self._ranges.pop().__exit__(None, None, None)
        if self._running:
            self._running = False
            self._prof.stop()

    # --- internals -------------------------------------------------------------------------------

    def _done(self) -> bool:
        return self._total > 0 and self._steps >= self._total

    def _write(self, prof: profile) -> None:
        """``tensorboard_trace_handler``'s file name (``rank<R>.<ns>.pt.trace.json``), written atomically."""
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        path = self.trace_dir / f"rank{self.rank}.{time.time_ns()}.pt.trace.json"
        tmp = temporary_path(path)
        try:
            prof.export_chrome_trace(str(tmp))
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        self.traces.append(path)
