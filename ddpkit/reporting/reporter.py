"""Everything the training loop reports, owned by one object: the loop computes, steps, reports.

    reporter = Reporter(config, runtime=runtime, total_steps=1000, progress=progress, resumed=False)
    with reporter.span("forward"):           # a timeline span (and the phase others may watch)
        loss = model(x)
    reporter.add_loss(loss, owner=Trainer)    # every micro-batch: kept on the device, no sync
    reporter.step_done(progress)              # the console's progress display, debug step log
    record = reporter.training(progress, lr=0.05)    # every log_every steps: loss over ranks, sinks, console
    with reporter.outside_training("evaluation"):   # left out of samples/s
        metrics = evaluate(model)
    reporter.validation(progress, metrics)    # {"val_accuracy": 0.97, ...}: sinks and a log line
    reporter.close()

It owns rank 0's console (the progress display of :mod:`ddpkit.reporting.console`), the metric sinks (``metrics.jsonl``, TensorBoard), the debug
step log, the timeline and the samples/s window; the Trainer holds none of them. Records carry
the keys defined beside their writer in :mod:`ddpkit.reporting.log` (``ddpkit plot`` reads the same names).
Phase listeners (``add_phase_listener``) see a span's name as it starts and None as it ends, at
the cost of a method call: a watchdog can tell what each rank is doing without a collective. A
listener that names the spans it needs (``names=``) is not called for the others: the step path
calls only who asked.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from ddpkit.checkpoint.files import write_atomically
from ddpkit.config.schema import Config
from ddpkit.config.serialize import config_to_dict, dump_config
from ddpkit.data.elastic import per_rank_batch_size
from ddpkit.data.streaming import UNKNOWN_LENGTH
from ddpkit.distributed.process_group import Runtime
from ddpkit.errors import DdpkitError
from ddpkit.reporting import log as logs
from ddpkit.reporting.console import ProgressDisplay
from ddpkit.reporting.log import StepLog, log, setup_logging
from ddpkit.reporting.sinks import SinkGroup, build_sinks
from ddpkit.reporting.timeline import Timeline
from ddpkit.training.metrics import RunningMean

__all__ = ["Reporter", "start_logging"]


def start_logging(config: Config, *, rank: int) -> None:
    """Rank-aware logging for this run; rank 0 also writes the resolved ``config.yaml`` first thing."""
    output_dir = Path(config.output_dir)
    log_dir = output_dir / "logs" if (config.log.rank_files or config.dist.debug) else None
    setup_logging(rank, all_ranks=config.log.all_ranks, log_dir=log_dir)
    if rank == 0:
        output_dir.mkdir(parents=True, exist_ok=True)
        write_atomically(output_dir / "config.yaml", dump_config(config).encode())


class Reporter:
    """Console progress display, metric sinks, step log, timeline and throughput of one run, on one rank."""

    def __init__(self, config: Config, *, runtime: Runtime, total_steps: int, progress: Any, resumed: bool):
        cfg, rank = config, runtime.env.rank
        self.config, self.runtime, self.total_steps, self.is_main = config, runtime, int(total_steps), rank == 0
        self.output_dir = Path(config.output_dir)
        self.per_rank_batch = per_rank_batch_size(cfg.data, world_size=runtime.env.world_size, grad_accum_steps=cfg.train.grad_accum_steps)
        self.samples_per_step = self.per_rank_batch * cfg.train.grad_accum_steps * runtime.env.world_size
        self.timeline = Timeline(enabled=cfg.train.timeline, rank=rank, device=runtime.device)
        self.step_log = StepLog(self.output_dir / "logs" / f"steps-rank{rank}.log" if cfg.dist.debug else None)
        # Rank 0's sinks: metrics.jsonl, status.json, trackers. RunState saves their state (a tracker's run id).
        self.sinks = build_sinks(cfg, append=resumed) if self.is_main else SinkGroup([])
        self._show_bar = self.is_main and cfg.log.progress_bar
        known = total_steps < UNKNOWN_LENGTH  # a stream without len() and without train.max_steps: no total
        self.console = ProgressDisplay(total=int(total_steps) if known else None, initial=progress.step, enabled=self._show_bar, every=cfg.log.progress_every)
        self._window_start, self._window_step = time.perf_counter(), progress.step
        self._outside = 0  # depth of outside_training spans
        self._phase_listeners: list[tuple[Callable[[str | None], None], frozenset[str] | None]] = []
        self._phase_spans: dict[str, _PhaseSpan] = {}  # one reusable span per phase name
        self._loss = RunningMean(runtime.device)

    # --- phases and time ---------------------------------------------------------------------

    def add_phase_listener(self, listener: Callable[[str | None], None], *, names: Iterable[str] | None = None) -> None:
        """Call ``listener(name)`` when a span starts and ``listener(None)`` when it ends; with
        ``names``, only for spans of those names (the listener then sees no others, nested or not)."""
        self._phase_listeners.append((listener, None if names is None else frozenset(names)))
        self._phase_spans.clear()

    def span(self, name: str) -> contextlib.AbstractContextManager[Any]:
        """Work of kind ``name`` (data, forward, backward, optimizer, ...) on the timeline.

        Called several times per step: with no listener it is the timeline's own span (free when
        the timeline is off), so reporting adds nothing to the step path.
        """
        span = self._phase_spans.get(name)
        if span is None:  # the step path reuses it: no object per span, one call per listener that asked
            listeners = tuple(listener for listener, names in self._phase_listeners if names is None or name in names)
            span = self._phase_spans[name] = _PhaseSpan(name, listeners)
        if self.timeline.enabled:
            return _WatchedSpan(self.timeline.span(name), span)
        return span if span.listeners else self.timeline.span(name)

    @contextlib.contextmanager
    def outside_training(self, name: str) -> Iterator[None]:
        """Work recorded as span ``name`` and left out of samples/s, which measures training only."""
        started = time.perf_counter()
        self._outside += 1
        try:
            with self.span(name):
                yield
        finally:
            self._outside -= 1
        if not self._outside:  # a nested one (a compile during evaluation) is inside the outer one's time
            self._window_start += time.perf_counter() - started

    def note(self, fmt: str, *args: Any) -> None:
        """A line in debug mode's per-rank step log (formatted only when the log is on)."""
        self.step_log.write(fmt, *args)

    # --- what happened -------------------------------------------------------------------------

    def start(self, *, steps_per_epoch: int, step: int) -> None:
        """The run's opening lines: world, batch arithmetic, length, where it writes."""
        cfg, rt = self.config, self.runtime
        self.sinks.start(config_to_dict(cfg))  # after RunState handed the sinks their resumed state
        world_size = rt.env.world_size
        log.info(
            "world_size=%d backend=%s device=%s launcher=%s | per-rank batch %d x %d ranks x %d accumulation = global batch %d",
            world_size, rt.backend, rt.device, rt.env.launcher, self.per_rank_batch, world_size, cfg.train.grad_accum_steps, self.samples_per_step,
        )
        log.info(
            "%s steps per epoch, %s steps in total%s; writing to %s",
            *(n if n < UNKNOWN_LENGTH else "unknown (a stream)" for n in (steps_per_epoch, self.total_steps)),
            f", resuming at step {step}" if step else "", self.output_dir,
        )

    def add_loss(self, loss: Any, *, owner: type) -> None:
        """Keep a micro-batch's loss for the next record (no host sync); ``owner`` is the class whose training_step made it."""
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
            raise DdpkitError(f"{owner.__name__}.training_step must return a scalar loss tensor, got {_describe(loss)}")
        self._loss.add(loss)

    @property
    def loss_pending(self) -> bool:
        """Whether losses were added since the last record (the same on every rank)."""
        return self._loss.pending

    def step_done(self, progress: Any) -> None:
        """After every optimizer step: advance the progress display, note the step in the debug log."""
        self.console.update()
        self.step_log.write("step %d done (epoch %d, batch %d)", progress.step, progress.epoch, progress.batch_in_epoch)

    def training(self, progress: Any, *, lr: float, extra: dict[str, float] | None = None) -> dict[str, Any]:
        """Record the loss averaged over ranks and steps (a collective) and the samples/s since the last record.

        ``extra``: more fields of the record, the same on every rank (the health metrics: ``grad_norm``, ...).
        """
        now, step = time.perf_counter(), progress.step
        loss = self._loss.read()
        samples = (step - self._window_step) * self.samples_per_step
        record = {
            logs.STEP: step,
            logs.EPOCH: progress.epoch,
            logs.TRAIN_LOSS: loss,
            logs.LR: lr,
            logs.SAMPLES_PER_S: samples / max(now - self._window_start, 1e-9),
            **(extra or {}),
            logs.TIME: time.time(),
        }
        norm = record.get(logs.GRAD_NORM, math.nan)
        self._window_start, self._window_step = now, step
        self.sinks.write(record)
        self.console.show({"loss": loss, "grad_norm": norm, "samples/s": round(record[logs.SAMPLES_PER_S]), "lr": lr})
        if not self._show_bar:
            log.info("step %d epoch %d loss %.4f grad_norm %.4g lr %.3g %.0f samples/s", step, progress.epoch, loss, norm, lr, record[logs.SAMPLES_PER_S])
        return record

    def validation(self, progress: Any, metrics: dict[str, float]) -> None:
        """Record exact validation metrics (already prefixed ``val_``)."""
        self.sinks.write({logs.STEP: progress.step, logs.EPOCH: progress.epoch, **metrics, logs.TIME: time.time()})
        log.info("step %d validation: %s", progress.step, ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))

    def write_timeline(self) -> None:
        """Merge every rank's spans into ``<output_dir>/timeline.json`` (a collective; when enabled)."""
        self.timeline.write(self.output_dir / "timeline.json")

    def close(self, status: str = "FINISHED") -> None:
        """Close the bar, the sinks and the step log (safe to call twice); ``status``: FINISHED, FAILED or KILLED."""
        self.console.close()
        self.sinks.finish(status, [self.output_dir / "model.pt"] if status == "FINISHED" else [])
        self.step_log.close()


class _WatchedSpan:
    """A timeline span that also tells the phase listeners when it starts and ends."""

    __slots__ = ("inner", "phase")

    def __init__(self, inner: contextlib.AbstractContextManager[Any], phase: _PhaseSpan):
        self.inner, self.phase = inner, phase

    def __enter__(self) -> None:
        self.phase.__enter__()
        self.inner.__enter__()

    def __exit__(self, *exc: object) -> None:
        self.inner.__exit__(*exc)
        self.phase.__exit__()


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__} {value!r:.60}"


class _PhaseSpan:
    """Tells the listeners of phase ``name`` that it starts and ends (reused: phases of one name never nest)."""

    __slots__ = ("name", "listeners")

    def __init__(self, name: str, listeners: tuple[Callable[[str | None], None], ...]):
        self.name, self.listeners = name, listeners

    def __enter__(self) -> None:
        for listener in self.listeners:
            listener(self.name)

    def __exit__(self, *exc: object) -> None:
        for listener in self.listeners:
            listener(None)
