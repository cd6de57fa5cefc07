"""Rank-aware logging, the metrics file's keys and writer (JSON lines, TensorBoard), the debug step log.

    setup_logging(rank=0, log_dir="runs/x/logs")      # [rank0] 12:00:01 INFO ... on stderr (+ logs/rank0.log)
    console_through(display)                          # while a live bar shows: log lines go above it
    MetricSinks("runs/x", enabled=True).write({"step": 40, "train_loss": 0.31})   # metrics.jsonl

* Python ``logging`` under the ``ddpkit`` logger, each line tagged with the rank. Rank 0 logs at
  INFO, the others at WARNING (``log.all_ranks: true`` shows every rank), optionally also to
  ``<output_dir>/logs/rank<N>.log``.
* The progress display itself (rank 0's bar, or progress lines in a batch log) is
  :mod:`ddpkit.reporting.console`; it routes the console log lines through itself with :func:`console_through`.
* ``metrics.jsonl`` in the run directory: one JSON object per logged step or evaluation, written
  by rank 0 and flushed as it goes, so a crashed run keeps its history.
* TensorBoard event files with ``torch.utils.tensorboard`` when ``log.tensorboard: true``.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

from ddpkit.errors import DdpkitError

__all__ = ["setup_logging", "console_through", "MetricSinks", "StepLog", "METRICS_FILE"]

log = logging.getLogger("ddpkit")

# The keys of metrics.jsonl, beside the writer; `ddpkit plot` reads the same names. Training
# records hold step, epoch, train_loss, lr, samples_per_s, time; evaluation records hold step,
# epoch, val_<metric>..., time.
METRICS_FILE = "metrics.jsonl"
STEP, EPOCH, TIME = "step", "epoch", "time"
TRAIN_LOSS, LR, SAMPLES_PER_S = "train_loss", "lr", "samples_per_s"
GRAD_NORM = "grad_norm"  # written by ddpkit.training.health with the skip and spike counters
VAL_PREFIX = "val_"


def setup_logging(rank: int, *, all_ranks: bool = False, log_dir: str | Path | None = None) -> logging.Logger:
    """Configure the ``ddpkit`` logger for this rank (idempotent: replaces earlier handlers)."""
    for handler in list(log.handlers):
        log.removeHandler(handler)
        handler.close()
    log.setLevel(logging.INFO if rank == 0 or all_ranks else logging.WARNING)
    log.propagate = False
    formatter = logging.Formatter(f"[rank{rank}] %(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    console = _ConsoleHandler()
    console.setFormatter(formatter)
    log.addHandler(console)
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(Path(log_dir) / f"rank{rank}.log")
        file_handler.setFormatter(formatter)
        file_handler.setLevel(logging.INFO)
        log.addHandler(file_handler)
        log.setLevel(logging.INFO)
        console.setLevel(logging.INFO if rank == 0 or all_ranks else logging.WARNING)
    return log


class _ConsoleHandler(logging.StreamHandler):
    """Writes to stderr, through the console's display while a live bar shows, so log lines do not break it."""

    display: Any = None

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    def emit(self, record: logging.LogRecord) -> None:
        display = _ConsoleHandler.display
        if display is None:
            super().emit(record)
            return
        try:
            display.write(self.format(record), file=sys.stderr)
        except Exception:  # logging must never raise into the training loop
            self.handleError(record)


def console_through(writer: Any) -> None:
    """Send console log lines through ``writer.write(line, file=...)`` (a live progress bar that
    must not be broken, see :mod:`ddpkit.reporting.console`), or straight to stderr again with None."""
    _ConsoleHandler.display = writer


class MetricSinks:
    """Where rank 0 records metrics: ``metrics.jsonl`` always, TensorBoard optionally."""

    def __init__(self, output_dir: str | Path, *, enabled: bool, tensorboard: bool = False, append: bool = True):
        """``append=False`` starts ``metrics.jsonl`` afresh (a new run); a resumed run appends."""
        self._jsonl = None
        self._tb = None
        if not enabled:
            return
        output_dir = Path(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        # The writer first: a missing tensorboard package then raises before metrics.jsonl is
        # opened, instead of leaking its file handle.
        if tensorboard:
            self._tb = _tensorboard_writer(output_dir / "tensorboard")
        self._jsonl = open(output_dir / METRICS_FILE, "a" if append else "w", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (must contain ``step``); non-finite floats become null in JSON."""
        if self._jsonl is not None:
            clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
            self._jsonl.write(json.dumps(clean) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for key, value in record.items():
                # Not "time": TensorBoard stamps each event with wall time itself, and a Unix time
                # stored as a float32 scalar is only accurate to about two minutes.
                if key not in (STEP, TIME) and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, global_step=record[STEP])

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _tensorboard_writer(log_dir: Path) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise DdpkitError(
            "log.tensorboard=true needs the tensorboard package, which is not installed: "
            "pip install 'ddpkit[tensorboard]' (or set log.tensorboard=false)"
        ) from None
    return SummaryWriter(log_dir=str(log_dir))


class StepLog:
    """Debug mode's per-rank trail: one timestamped line per step and collective, flushed at once.

    When a job hangs, the last line of each rank's file says where it stopped, so the rank that
    is behind (or stuck before a collective) stands out. A no-op when ``path`` is None.
    """

    def __init__(self, path: str | Path | None):
        self._file = None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8", buffering=1)

    def write(self, fmt: str, *args: Any) -> None:
        """Append ``fmt % args`` (formatted only when the log is on: free in the step loop otherwise)."""
        if self._file is not None:
            now = time.time()
            self._file.write(f"{time.strftime('%H:%M:%S', time.localtime(now))}.{int(now * 1000) % 1000:03d} {fmt % args}\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
