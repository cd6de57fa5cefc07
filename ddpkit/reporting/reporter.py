"""Everything the training loop reports, owned by one object: the loop computes, steps, reports.

    reporter = Reporter(config, runtime=runtime, total_steps=1000, progress=progress, events=events)
    reporter.start(steps_per_epoch=100, step=0, resumed=False)   # after resume: opens the sinks
    with reporter.span("forward"):           # a timeline span, and on_phase for the loop's listeners
        loss = model(x)
    reporter.add_loss(loss)                   # every micro-batch: kept on the device, no sync (or loss_sum, n_tokens)
    reporter.add_stage_time(stage=0, busy=0.03, span=0.04, theory=0.2, spans=spans)   # a pipeline stage, every step
    reporter.step_done(progress)              # the console's progress display, debug step log
    record = reporter.training(progress, lr=0.05)    # every log_every steps: loss over ranks, sinks, console
    with reporter.outside_training("evaluation"):   # left out of samples/s
        metrics = evaluate(model)
    reporter.validation(progress, metrics)    # {"val_accuracy": 0.97, ...}: sinks and a log line
    reporter.on_exit("FINISHED")             # the run's listeners hear it, in the list's order

It owns rank 0's console (the progress display of :mod:`ddpkit.reporting.console`), the metric sinks
(``metrics.jsonl``, TensorBoard), the debug step log, the timeline and the samples/s window; the Trainer holds
none of them. Records carry the keys defined beside their writer in :mod:`ddpkit.reporting.log` (``ddpkit plot``
reads the same names).
Every span is an event on the run's one listener list (:class:`ddpkit.reporting.events.Events`):
a listener's ``on_phase`` hears a span's name as it starts and None as it ends, at the cost of a
method call. A listener that names the spans it needs (its ``phases``) is not called for the others:
the step path calls only who asked. What each rank is doing needs no call at all: the spans write it
into the events' ``position``, which the hang watchdog reads from its own thread.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ddpkit.atomic import write_atomically
from ddpkit.config.schema import Config
from ddpkit.config.serialize import config_to_dict, dump_config
from ddpkit.data.elastic import per_rank_batch_size
from ddpkit.data.streaming import UNKNOWN_LENGTH
from ddpkit.distributed.process_group import Runtime
from ddpkit.progress import Progress
from ddpkit.reporting import log as logs
from ddpkit.reporting.console import ProgressDisplay
from ddpkit.reporting.events import Events, PhaseSpan
from ddpkit.reporting.log import StepLog, log, setup_logging
from ddpkit.reporting.running_mean import RunningMean
from ddpkit.reporting.sinks import SinkGroup, build_sinks
from ddpkit.reporting.stage_time import StageTimes
from ddpkit.reporting.throughput import TokenThroughput
from ddpkit.reporting.timeline import Timeline

__all__ = ["Reporter", "start_logging"]


def start_logging(config: Config, *, rank: int) -> None:
    """Rank-aware logging for this run; rank 0 also writes the resolved ``config.yaml`` first thing."""
    output_dir = Path(config.output_dir)
    log_dir = output_dir / "logs" if (config.log.rank_files or config.dist.debug) else None
    setup_logging(rank, all_ranks=config.log.all_ranks, log_dir=log_dir)
    if rank == 0:
        output_dir.mkdir(parents=True, exist_ok=True)
        text = dump_config(config)
        path = output_dir / "config.yaml"
        # A restart of the same run: no second durable write
        if not path.is_file() or path.read_text() != text:
            write_atomically(path, text, durable=True)


class Reporter:
    """Console progress display, metric sinks, step log, timeline and throughput of one run, on one rank."""

    def __init__(
        self,
        config: Config,
        *,
        runtime: Runtime,
        total_steps: int,
        progress: Progress,
        events: Events,
        throughput: TokenThroughput | None = None,
        replicas: int | None = None,
        accumulation: int | None = None,
    ):
        """``replicas``: the data-parallel degree, the ranks that read different batches (the layout's ``dp``);
        every rank when None. The ranks of one pipeline or one tensor-parallel group read the same batches.
        ``accumulation``: the batches a replica takes a step (a pipeline's M microbatches, as the layout's data
        config holds them); ``train.grad_accum_steps`` when None."""
        cfg = config
        rank = runtime.env.rank
        self.config = config
        self.runtime = runtime
        self.total_steps = int(total_steps)
        self.is_main = rank == 0
        self.output_dir = Path(config.output_dir)
        #: How many ranks read different batches, and how many batches each takes a step (a pipeline's M microbatches).
        self.replicas = replicas if replicas is not None else runtime.env.world_size
        self.accumulation = accumulation if accumulation is not None else cfg.train.grad_accum_steps
        # As the training loader computes it (ddpkit.data.loaders): each replica's (micro-)batch.
        self.per_rank_batch = per_rank_batch_size(
            cfg.data, world_size=self.replicas, grad_accum_steps=self.accumulation
        )
        self.samples_per_step = self.per_rank_batch * self.accumulation * self.replicas
        self.timeline = Timeline(enabled=cfg.train.timeline, rank=rank, device=runtime.device)
        self.step_log = StepLog(self.output_dir / "logs" / f"steps-rank{rank}.log" if cfg.dist.debug else None)
        # Rank 0's sinks (metrics.jsonl, status.json, trackers) open in start(), once resume is decided;
        # The checkpointer saves and restores their state (a tracker's run id) through this group.
        self.sinks = SinkGroup([])
        self._show_bar = self.is_main and cfg.log.progress_bar
        # A stream without len() and without train.max_steps: no total
        known = total_steps < UNKNOWN_LENGTH
        self.console = ProgressDisplay(
            total=int(total_steps) if known else None,
            initial=progress.step,
            enabled=self._show_bar,
            every=cfg.log.progress_every,
        )
        self._window_start = time.perf_counter()
        self._window_step = progress.step
        #: How many outside_training spans are open (nested ones inside the outer one's time).
        self._outside = 0
        self.events = events
        # tokens_per_s and mfu, for runs that train on tokens
        self.throughput = throughput or TokenThroughput()
        self._loss = RunningMean(runtime.device)
        #: Under a pipeline: this stage's busy and idle time in the schedule (ddpkit.reporting.stage_time).
        self.stage_times = StageTimes()

    # --- phases and time ---------------------------------------------------------------------

    def span(self, name: str) -> contextlib.AbstractContextManager[Any]:
        """Work of kind ``name`` (data, forward, backward, optimizer, ...) on the timeline.

        Called several times per step: with the timeline off it is the events' reused span of that name, whose
        enter and exit call its listeners (with none, a loop over nothing: as cheap as a null context).
        """
        span = self.events.phase(name)
        if self.timeline.enabled:
            return _WatchedSpan(self.timeline.span(name), span)
        return span

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
        # Only the outermost: a nested one (a compile during evaluation) is inside the outer one's time
        if not self._outside:
            self._window_start += time.perf_counter() - started

    def note(self, fmt: str, *args: Any) -> None:
        """A line in debug mode's per-rank step log (formatted only when the log is on)."""
        self.step_log.write(fmt, *args)

    # --- what happened -------------------------------------------------------------------------

    def start(self, *, steps_per_epoch: int, step: int, resumed: bool) -> None:
        """Open rank 0's sinks (a resumed run appends to ``metrics.jsonl``), then the run's opening lines."""
        cfg = self.config
        rt = self.runtime
        if self.is_main:
            self.sinks.extend(build_sinks(cfg, append=resumed))
        # After resume: the checkpoint's sink states are loaded, so a tracker continues its run
        self.sinks.start(config_to_dict(cfg))
        log.info(
            "world_size=%d backend=%s device=%s launcher=%s | %s",
            rt.env.world_size,
            rt.backend,
            rt.device,
            rt.env.launcher,
            self._batch_line(),
        )
        log.info(
            "%s steps per epoch, %s steps in total%s; writing to %s",
            *(n if n < UNKNOWN_LENGTH else "unknown (a stream)" for n in (steps_per_epoch, self.total_steps)),
            f", resuming at step {step}" if step else "",
            self.output_dir,
        )

    def _batch_line(self) -> str:
        """How the global batch is split: over ranks and accumulation, or over data-parallel replicas (each a
        tensor-parallel group, or a pipeline's stages) and microbatches."""
        parallel = self.config.parallel
        batch = self.per_rank_batch
        if parallel.pipeline == 1 and parallel.tensor == 1:
            return (
                f"per-rank batch {batch} x {self.replicas} ranks x {self.accumulation} "
                f"accumulation = global batch {self.samples_per_step}"
            )
        tensor = f", tensor parallel over {parallel.tensor} ranks" if parallel.tensor > 1 else ""
        if parallel.pipeline == 1:
            return (
                f"per-replica batch {batch} x {self.replicas} data-parallel replica(s) x {self.accumulation} "
                f"accumulation = global batch {self.samples_per_step} ({tensor.removeprefix(', ')})"
            )
        return (
            f"microbatch {batch} x {self.accumulation} microbatches x {self.replicas} data-parallel replica(s) = "
            f"global batch {self.samples_per_step} (pipeline of {parallel.pipeline} stages{tensor})"
        )

    def add_loss(self, loss: torch.Tensor, tokens: torch.Tensor | None = None) -> None:
        """Keep a micro-batch's loss for the next record (no host sync): a mean, or a sum over ``tokens`` tokens."""
        self._loss.add(loss, tokens)

    def add_stage_time(
        self, *, stage: int, busy: float, span: float, theory: float | None, spans: list[tuple[str, int, int]]
    ) -> None:
        """A pipeline stage's step: ``busy`` seconds of compute in ``span`` seconds of schedule, for the next record;
        ``spans``, its compute as ``(name, start_ns, end_ns)`` on ``time.time_ns``'s clock, for the timeline."""
        self.stage_times.add(stage=stage, busy=busy, span=span, theory=theory)
        self.timeline.extend(spans)

    @property
    def loss_pending(self) -> bool:
        """Whether losses were added since the last record (the same on every rank)."""
        return self._loss.pending

    def step_done(self, progress: Progress) -> None:
        """After every optimizer step: advance the progress display, note the step in the debug log."""
        self.console.update()
        self.step_log.write("step %d done (epoch %d, batch %d)", progress.step, progress.epoch, progress.batch_in_epoch)

    def training(self, progress: Progress, *, lr: float, extra: dict[str, float] | None = None) -> dict[str, Any]:
        """Record the loss averaged over ranks and steps (a collective) and the samples/s since the last record.

        ``extra``: more fields of the record, the same on every rank (the health metrics: ``grad_norm``, ...).
        """
        now = time.perf_counter()
        step = progress.step
        loss = self._loss.read()
        samples = (step - self._window_step) * self.samples_per_step
        seconds = now - self._window_start
        record = {
            logs.STEP: step,
            logs.EPOCH: progress.epoch,
            logs.TRAIN_LOSS: loss,
            logs.LR: lr,
            logs.SAMPLES_PER_S: samples / max(seconds, 1e-9),
            **self.throughput.fields(samples=samples, seconds=seconds),
            # Under a pipeline: each stage's busy seconds and idle share (a collective).
            **self.stage_times.fields(),
            **(extra or {}),
            logs.TIME: time.time(),
        }
        norm = record.get(logs.GRAD_NORM, math.nan)
        self._window_start = now
        self._window_step = step
        self.sinks.write(record)
        rate = (
            {"tokens/s": round(record["tokens_per_s"])}
            if "tokens_per_s" in record
            else {"samples/s": round(record[logs.SAMPLES_PER_S])}
        )
        self.console.show({"loss": loss, "grad_norm": norm, **rate, "lr": lr})
        if not self._show_bar:
            ((unit, value),) = rate.items()
            log.info(
                "step %d epoch %d loss %.4f grad_norm %.4g lr %.3g %.0f %s%s",
                step,
                progress.epoch,
                loss,
                norm,
                lr,
                value,
                unit,
                f" mfu {record['mfu']:.1%}" if "mfu" in record else "",
            )
        return record

    def validation(self, progress: Progress, metrics: dict[str, float]) -> dict[str, float]:
        """Record exact validation metrics (already prefixed ``val_``); return them, with ``val_ppl``
        (the exponential of the token-weighted ``val_loss``) added for runs that train on tokens."""
        if self.throughput.enabled and "val_loss" in metrics:
            # exp(710) overflows a float
            metrics = {**metrics, "val_ppl": math.exp(min(metrics["val_loss"], 700.0))}
        self.sinks.write({logs.STEP: progress.step, logs.EPOCH: progress.epoch, **metrics, logs.TIME: time.time()})
        log.info("step %d validation: %s", progress.step, ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        return metrics

    def write_timeline(self) -> None:
        """Merge every rank's spans into ``<output_dir>/timeline.json`` (a collective; when enabled)."""
        self.timeline.write(self.output_dir / "timeline.json")

    def on_exit(self, status: str) -> None:
        """Close the bar, the sinks and the step log (safe to call twice); ``status``: FINISHED, FAILED or STOPPED
        (a signal stopped the run after saving, which trackers call KILLED)."""
        status = "KILLED" if status == "STOPPED" else status
        self.console.close()
        self.sinks.finish(status, [self.output_dir / "model.pt"] if status == "FINISHED" else [])
        self.step_log.close()


class _WatchedSpan:
    """A timeline span that also tells the phase listeners when it starts and ends."""

    __slots__ = ("inner", "phase")

    def __init__(self, inner: contextlib.AbstractContextManager[Any], phase: PhaseSpan):
        self.inner = inner
        self.phase = phase

    def __enter__(self) -> None:
        self.phase.__enter__()
        self.inner.__enter__()

    def __exit__(self, *exc: object) -> None:
        self.inner.__exit__(*exc)
        self.phase.__exit__()
