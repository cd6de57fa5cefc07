"""The goodput ledger: each attempt appends the moments that decide where a run's time went.

    with GoodputLedger.for_run(config, runtime, progress=trainer.progress, stop=stop) as ledger:
        ...                                   # build, then restore:
        resumed = ledger.restore(state.resume)  # timed; records the step training resumes at
        events.add(ledger)                    # on_step_end: steps; on_phase: checkpoint and validation spans
    # on the way out: an "end" line (FINISHED, STOPPED or FAILED) with the last completed step

    ddpkit goodput runs/exp                   # the report (ddpkit.tools.goodput)

``<output_dir>/goodput.jsonl`` holds one JSON object per line, ``{"event", "t", "session",
"attempt", "rank", ...}`` with ``t`` in seconds since the epoch. Events: ``launch`` / ``exit``
(``ddpkit run`` itself, :func:`launch_session`; ``gone``: when its process ended, written by a
watcher), ``agent_fault`` (``ddpkit run``'s agent saw an attempt fail: :mod:`ddpkit.goodput.faults`),
``start`` (the worker's process start, read from ``/proc``, with ``imported`` and ``ready``: torch
imported, process group up), ``restore`` (``began``, the restored ``step``, its ``source``),
``first_step``, ``progress`` (the step reached, about once a second, so a fault's lost work is known
to within a second), ``checkpoint`` (``began``, ``step``, ``kind``: disk, memory or crash),
``validation`` (``began``, ``step``) and ``end`` (the last step, when it completed, the status).

Rank 0 writes the ledger; any rank writes the ``checkpoint`` line of a crash save it makes and, when its attempt
failed, its ``end`` line (the last step before a fault, whichever rank died). A line
is one ``os.write`` on an ``O_APPEND`` file, so lines of different processes never interleave.
The training thread's cost per step is one clock read and a comparison in ``on_step_end``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

from ddpkit.config.schema import Config
from ddpkit.distributed.process_group import Runtime
from ddpkit.distributed.processes import proc_stat
from ddpkit.errors import EXIT_PREEMPTED
from ddpkit.progress import Progress

__all__ = [
    "LEDGER_FILE",
    "SESSION_ENV",
    "GOODPUT_DIR_ENV",
    "GoodputLedger",
    "launch_session",
    "append_event",
    "process_start_time",
]

LEDGER_FILE = "goodput.jsonl"
#: Set by `ddpkit run`; every attempt it launches shares it
SESSION_ENV = "DDPKIT_GOODPUT_SESSION"
#: Set by `ddpkit run`: the run's output directory
GOODPUT_DIR_ENV = "DDPKIT_GOODPUT_DIR"
#: Seconds between "progress" lines: the resolution of "progress lost to faults"
PROGRESS_INTERVAL = 1.0
#: The trainer imports torch before this module: the end of the import cost
_IMPORTED = time.time()


def process_start_time(pid: int | str = "self") -> float:
    """When process ``pid`` started (seconds since the epoch), from ``/proc``; now where unknown.

    The interpreter's own start-up and ``import torch`` happen before any of our code runs, so the
    kernel's record is the only honest start of an attempt.
    """
    try:
        # None (no /proc) raises TypeError, handled below
        ticks = int(proc_stat(pid)[19])  # type: ignore[index]
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        # The age from uptime (10 ms resolution), not /proc/stat's btime (whole seconds).
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, TypeError):
        return time.time()


def _identity() -> tuple[str, int]:
    session = os.environ.get(SESSION_ENV) or os.environ.get("TORCHELASTIC_RUN_ID") or f"pid{os.getppid()}"
    return session, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def append_event(output_dir: str | os.PathLike, event: str, **fields: Any) -> None:
    """Append one ledger line (any process, any rank). Never raises: the ledger must not stop a run."""
    session, attempt = _identity()
    record = {
        "event": event,
        "t": fields.pop("t", None) or time.time(),
        "session": session,
        "attempt": attempt,
        "rank": int(os.environ.get("RANK", "0")),
        **fields,
    }
    try:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        fd = os.open(Path(output_dir) / LEDGER_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(record) + "\n").encode())
        finally:
            os.close(fd)
    except OSError:
        pass


# Run by a detached `python -S`: waits for the launcher to end, then records when (its own
# interpreter teardown, seconds on a busy machine, happens after anything it could write itself).
_WATCH = """
import json, os, sys, time
pid, path, session = int(sys.argv[1]), sys.argv[2], sys.argv[3]
def gone():
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True
while not gone():
    time.sleep(0.02)
fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
record = {"event": "gone", "t": time.time(), "session": session, "attempt": 0, "rank": 0}
os.write(fd, (json.dumps(record) + "\\n").encode())
"""


def _watch_exit(output_dir: str | os.PathLike) -> None:
    if not Path("/proc/self/stat").exists():
        return
    ledger = str(Path(output_dir) / LEDGER_FILE)
    argv = [sys.executable, "-S", "-c", _WATCH, str(os.getpid()), ledger, os.environ[SESSION_ENV]]
    try:
        quiet = subprocess.DEVNULL
        subprocess.Popen(argv, stdin=quiet, stdout=quiet, stderr=quiet, start_new_session=True)
    except OSError:
        # The exit line written below is then the session's end
        pass


@contextlib.contextmanager
def launch_session(output_dir: str | os.PathLike) -> Iterator[None]:
    """``ddpkit run``'s share: its own start and exit, and a session id its workers inherit."""
    os.environ.setdefault(SESSION_ENV, uuid.uuid4().hex[:12])
    # Where the launcher's agent writes its fault lines (launch.launcher)
    os.environ[GOODPUT_DIR_ENV] = str(output_dir)
    append_event(output_dir, "launch", t=process_start_time())
    _watch_exit(output_dir)
    code: Any = "error"
    try:
        yield
        code = 0
    except SystemExit as exc:
        code = exc.code
        raise
    finally:
        append_event(output_dir, "exit", code=code)


class Stopping(Protocol):
    """The run's stop on a signal (:class:`ddpkit.checkpoint.preemption.StopOnSignal`), as the ledger reads it."""

    stopped: bool


class GoodputLedger:
    """One attempt's ledger on one rank (only rank 0's writes, but for a crash save's line and a failed
    attempt's end)."""

    def __init__(
        self,
        output_dir: str | os.PathLike | None,
        *,
        progress: Progress,
        run_dir: str | os.PathLike = ".",
        stop: Stopping | None = None,
    ):
        self.output_dir = output_dir
        self.progress = progress
        self._dir = run_dir
        self._stop = stop
        self._span: list[str] = []
        self._began: dict[str, float] = {}
        self._first_done = False
        self._next_progress = 0.0
        self.last_step = 0
        self.last_step_time = time.time()

    @classmethod
    def for_run(cls, config: Config, runtime: Runtime, *, progress: Progress, stop: Stopping) -> GoodputLedger:
        """The ledger of this attempt: a writing one on rank 0, a silent one elsewhere (``stop``: the run's stop on
        a signal, whose ``stopped`` makes a run that ends without an error end STOPPED)."""
        output_dir = config.output_dir if runtime.env.rank == 0 else None
        return cls(output_dir, progress=progress, run_dir=config.output_dir, stop=stop)

    def _write(self, event: str, **fields: Any) -> None:
        if self.output_dir is not None:
            append_event(self.output_dir, event, **fields)

    def __enter__(self) -> GoodputLedger:
        # Forked from `ddpkit run`, a worker starts with torch imported: no import cost
        began = process_start_time()
        self._write("start", t=began, imported=max(_IMPORTED, began), ready=time.time(), pid=os.getpid())
        return self

    def status_of(self, exc: BaseException | None) -> str:
        """How the attempt ended: FINISHED, STOPPED (a signal stopped it after saving) or FAILED."""
        stopped = exc is None and self._stop is not None and self._stop.stopped
        stopped = stopped or getattr(exc, "exit_code", None) == EXIT_PREEMPTED
        return "STOPPED" if stopped else ("FINISHED" if exc is None else "FAILED")

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        status = self.status_of(exc)
        fields = {"step": self.last_step, "last_step_t": self.last_step_time, "status": status}
        if self.output_dir is not None:
            append_event(self.output_dir, "end", **fields)
        elif status == "FAILED":
            # Every rank writes it: the last step before a fault, whichever rank died (goodput.faults)
            append_event(self._dir, "end", **fields)

    def restore(self, resume: Callable[[], Any]) -> Any:
        """Time ``resume()`` (True or a source name when it restored a checkpoint) and record where training resumes."""
        began = time.time()
        resumed = resume()
        source = resumed if isinstance(resumed, str) else ("disk" if resumed else "none")
        self.last_step = self.progress.step
        self.last_step_time = time.time()
        self._write("restore", began=began, step=self.last_step, source=source)
        return resumed

    def checkpoint(self, *, began: float, step: int, kind: str, always: bool = False) -> None:
        """A save blocked training from ``began`` until now (``always``: written from any rank, e.g. a crash save)."""
        if always and self.output_dir is None:
            append_event(self._dir, "checkpoint", began=began, step=step, kind=kind)
        else:
            self._write("checkpoint", began=began, step=step, kind=kind)

    #: The spans :meth:`on_phase` hears (see :class:`ddpkit.reporting.events.Events`); a step's end is
    #: :meth:`on_step_end`, one call a step (hearing the optimizer span took two, and a call for the step).
    phases = ("checkpoint", "evaluation")

    def on_phase(self, name: str | None) -> None:
        """Phase listener: ``name`` starts, or (None) the innermost span ends. Cheap on the step path."""
        if name is not None:
            self._span.append(name)
            if name in ("checkpoint", "evaluation"):
                self._began[name] = time.time()
            return
        ended = self._span.pop() if self._span else None
        if ended == "checkpoint":
            self.checkpoint(began=self._began.pop("checkpoint", time.time()), step=self.progress.step, kind="disk")
        elif ended == "evaluation":
            self._write("validation", began=self._began.pop("evaluation", time.time()), step=self.progress.step)

    def on_step_end(self, step: int) -> None:
        """Step ``step`` is done: the first one and a progress mark about once a second go to the ledger."""
        now = time.time()
        self.last_step = step
        self.last_step_time = now
        if not self._first_done:
            self._first_done = True
            self._write("first_step", step=self.last_step)
            self._next_progress = now + PROGRESS_INTERVAL
        elif now >= self._next_progress:
            self._next_progress = now + PROGRESS_INTERVAL
            self._write("progress", step=self.last_step)
