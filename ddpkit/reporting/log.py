"""Rank-aware logging, the metrics file's keys and writer (JSON lines), the debug step log.

    setup_logging(rank=0, log_dir="runs/x/logs")      # [rank0] 12:00:01 INFO ... on stderr (+ logs/rank0.log)
    console_through(display)                          # while a live bar shows: log lines go above it
    MetricSinks("runs/x", enabled=True).write({"step": 40, "train_loss": 0.31})   # metrics.jsonl

* Python ``logging`` under the ``ddpkit`` logger, each line tagged with the rank. Rank 0 logs at
  INFO, the others at WARNING (``log.all_ranks: true`` shows every rank), optionally also to
  ``<output_dir>/logs/rank<N>.log``. When the program has configured logging (the root logger has a
  handler), the lines go to its handlers in its format instead of ddpkit's console, once each.
* The progress display itself (rank 0's bar, or progress lines in a batch log) is
  :mod:`ddpkit.reporting.console`; it routes the console log lines through itself with :func:`console_through`.
* ``metrics.jsonl`` in the run directory: one JSON object per logged step or evaluation, written
  by rank 0 and flushed as it goes, so a crashed run keeps its history.
* TensorBoard (``log.tensorboard: true``) is an optional sink of its own, in :mod:`ddpkit.reporting.sinks`.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any, Protocol, TextIO

__all__ = ["setup_logging", "console_through", "MetricSinks", "StepLog", "METRICS_FILE"]

log = logging.getLogger("ddpkit")

# The keys of metrics.jsonl, beside the writer; `ddpkit plot` reads the same names. Training
# records hold step, epoch, train_loss, lr, samples_per_s, time; evaluation records hold step,
# epoch, val_<metric>..., time.
METRICS_FILE = "metrics.jsonl"
STEP = "step"
EPOCH = "epoch"
TIME = "time"
TRAIN_LOSS = "train_loss"
LR = "lr"
SAMPLES_PER_S = "samples_per_s"
#: Written by ddpkit.training.health with the skip and spike counters
GRAD_NORM = "grad_norm"
VAL_PREFIX = "val_"


def setup_logging(rank: int, *, all_ranks: bool = False, log_dir: str | Path | None = None) -> logging.Logger:
    """Configure the ``ddpkit`` logger for this rank (idempotent: replaces earlier handlers).

    When the program has configured logging itself (the root logger has a handler: ``logging.basicConfig``,
    a JSON log shipper), ddpkit's records go to the root logger's handlers, in the program's format, and
    ddpkit prints no console line of its own: each line appears once. Otherwise ddpkit prints
    ``[rank0] 12:00:01 INFO ...`` on stderr, as always. The per-rank file (``log_dir``) is written either way.
    """
    for handler in list(log.handlers):
        log.removeHandler(handler)
        handler.close()
    level = logging.INFO if rank == 0 or all_ranks else logging.WARNING
    # INFO on every rank when there is a rank file: it keeps every rank's INFO lines
    log.setLevel(logging.INFO if log_dir is not None else level)
    # Forwarded by a handler rather than by `propagate`, so the root sees this rank's `level` only, not the
    # file's INFO; propagate stays off, so nothing is delivered twice.
    log.propagate = False
    formatter = logging.Formatter(f"[rank{rank}] %(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    # pytest's capture handlers sit on the root logger during every test, and pytest attaches them to
    # non-propagating loggers too (caplog sees ddpkit's records): they are not the program's logging.
    if any(not type(h).__module__.startswith("_pytest") for h in logging.getLogger().handlers):
        log.addHandler(_ToRoot(level))
    else:
        console = _ConsoleHandler()
        console.setFormatter(formatter)
        console.setLevel(level)
        log.addHandler(console)
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(Path(log_dir) / f"rank{rank}.log")
        file_handler.setFormatter(formatter)
        file_handler.setLevel(logging.INFO)
        log.addHandler(file_handler)
    return log


class _ToRoot(logging.Handler):
    """Hands records of this rank's level to the root logger's handlers (the program's logging), as propagation
    would."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger().handle(record)


class LineWriter(Protocol):
    """What prints log lines for the console handler while it owns the terminal (a live progress display)."""

    def write(self, line: str, file: TextIO | None = None) -> None: ...


class _ConsoleHandler(logging.StreamHandler):
    """Writes to stderr, through the console's display while a live bar shows, so log lines do not break it."""

    display: LineWriter | None = None

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    def emit(self, record: logging.LogRecord) -> None:
        display = _ConsoleHandler.display
        if display is None:
            super().emit(record)
            return
        try:
            display.write(self.format(record), file=sys.stderr)
        except Exception:
            # Logging must never raise into the training loop
            self.handleError(record)


def console_through(writer: LineWriter | None) -> None:
    """Send console log lines through ``writer.write(line, file=...)`` (a live progress bar that
    must not be broken, see :mod:`ddpkit.reporting.console`), or straight to stderr again with None."""
    _ConsoleHandler.display = writer


class MetricSinks:
    """``metrics.jsonl``, where rank 0 records metrics (TensorBoard is its own optional sink:
    :mod:`ddpkit.reporting.sinks`)."""

    def __init__(self, output_dir: str | Path, *, enabled: bool, append: bool = True):
        """``append=False`` starts ``metrics.jsonl`` afresh (a new run); a resumed run appends."""
        self._jsonl = None
        if not enabled:
            return
        output_dir = Path(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(output_dir / METRICS_FILE, "a" if append else "w", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (must contain ``step``); non-finite floats become null in JSON."""
        if self._jsonl is not None:
            clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
            self._jsonl.write(json.dumps(clean) + "\n")
            self._jsonl.flush()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None


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
            self._file.write(
                f"{time.strftime('%H:%M:%S', time.localtime(now))}.{int(now * 1000) % 1000:03d} {fmt % args}\n"
            )

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
