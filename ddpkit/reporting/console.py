"""Rank 0's progress display: a live bar on a terminal, plain lines in a batch job's log.

    display = ProgressDisplay(total=900, initial=0, every=30.0)
    for step in ...:
        display.update()                                   # once per optimizer step: cheap
        display.show({"loss": 0.41, "samples/s": 1530})    # whenever new numbers are known
        display.write("[rank0] 12:00:01 INFO step 300 validation: ...")   # a log line
    display.close()

* **stderr is a terminal**: a tqdm bar, redrawn at most once a second. Log lines go through
  :meth:`ProgressDisplay.write`, which clears the bar, prints the line and redraws the bar
  under it, so a line is never glued to a fragment of the bar.
* **stderr is a file or a pipe** (SLURM, CI, ``| tee``): no bar and no carriage returns, but one
  line every ``every`` seconds (``log.progress_every``) and one at the end, each complete::

      [rank0] 12:00:31 INFO progress: step 120/900 (13%) loss 0.4512 samples/s 1530 lr 0.05 eta 3m14s

  ``grep progress: slurm-1234.out`` is the run's pace; log lines in between stay intact.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from ddpkit.reporting.log import console_through

__all__ = ["ProgressDisplay", "format_duration"]

_log = logging.getLogger("ddpkit")


class ProgressDisplay:
    """Shows training progress on rank 0; with ``enabled=False`` every method is a no-op."""

    def __init__(
        self,
        *,
        total: int | None,
        initial: int = 0,
        enabled: bool = True,
        every: float = 30.0,
        stream: TextIO | None = None,
        terminal: bool | None = None,
        emit: Callable[[str], None] | None = None,
    ):
        """``total`` None: unknown (a stream); ``terminal`` defaults to ``stream.isatty()``; ``emit`` prints a
        plain progress line (default: an INFO line on the ``ddpkit`` logger, so it has the log's prefix and
        lands in ``log.rank_files`` too)."""
        self.total = total
        self.step = initial
        self.every = every
        self._stream = stream if stream is not None else sys.stderr
        self._enabled = enabled
        self._values: dict[str, Any] = {}
        self._bar: Any = None
        self._emit = emit or (lambda line: _log.info("%s", line))
        self._started = self._last_line = time.monotonic()
        self._initial = initial
        self._last_step = initial
        if enabled and (self._stream.isatty() if terminal is None else terminal):
            # Imported here, not at the top: keeps `import ddpkit` fast
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=total, initial=initial, unit="step", dynamic_ncols=True, mininterval=1.0, file=self._stream
            )
            # From here on ddpkit's log lines go through write(), above the bar
            console_through(self)

    @property
    def plain(self) -> bool:
        """True when progress is shown as plain lines (enabled, no terminal)."""
        return self._enabled and self._bar is None

    def update(self, steps: int = 1) -> None:
        """``steps`` more optimizer steps are done."""
        self.step += steps
        if self._bar is not None:
            self._bar.update(steps)
        elif self._enabled and time.monotonic() - self._last_line >= self.every:
            self._plain_line()

    def show(self, values: dict[str, Any]) -> None:
        """Numbers to show beside the step count (``loss``, ``samples/s``, ``lr``, ...)."""
        self._values.update(values)
        if self._bar is not None:
            self._bar.set_postfix({k: _short(v) for k, v in values.items()}, refresh=False)

    def write(self, line: str, file: TextIO | None = None) -> None:
        """Print one log line without breaking the bar (``file`` defaults to the display's stream)."""
        out = file or self._stream
        if self._bar is not None:
            # tqdm clears the bar, prints, redraws below
            self._bar.write(line, file=out)
        else:
            out.write(line + "\n")
            out.flush()

    def close(self) -> None:
        """Leave the finished bar on screen, or print a last plain line if steps were taken since the previous one."""
        if self._bar is not None:
            console_through(None)
            self._bar.close()
            self._bar = None
        elif self._enabled and self.step != self._last_step:
            self._plain_line()
        self._enabled = False

    def status_line(self) -> str:
        """``step 120/900 (13%) loss 0.4512 samples/s 1530 lr 0.05 eta 3m14s`` (``step 120`` when the total is
        unknown)."""
        total = self.total
        parts = [
            f"step {self.step}/{total} ({100.0 * self.step / max(total, 1):.0f}%)"
            if total is not None
            else f"step {self.step}"
        ]
        parts += [f"{k} {_short(v)}" for k, v in self._values.items()]
        done = self.step - self._initial
        elapsed = time.monotonic() - self._started
        if total is None or self.step >= total:
            parts.append(f"{'done in' if total is not None else 'for'} {format_duration(elapsed)}")
        elif done > 0:
            parts.append(f"eta {format_duration((total - self.step) * elapsed / done)}")
        return " ".join(parts)

    def _plain_line(self) -> None:
        self._last_line = time.monotonic()
        self._last_step = self.step
        self._emit(f"progress: {self.status_line()}")


def format_duration(seconds: float) -> str:
    """``42s``, ``3m14s``, ``2h05m``: short and unambiguous in a log line."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _short(value: Any) -> Any:
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return value
