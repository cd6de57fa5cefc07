"""The last word of a rank frozen while holding the GIL: its stacks and its place, written without Python.

    backstop = open_backstop(log_dir, rank=1, hang_timeout=20, step=19)   # <log_dir>/stacks-rank1.txt, fires 8 s
                                                                          # after a heartbeat
    backstop.at_step(20); backstop.at_phase("forward")   # training thread: slice writes into a mapped page
    backstop.arm()      # watchdog thread, every heartbeat: faulthandler dumps every thread's stack unless re-armed
                        # within 8 s
    backstop.close()    # end of fit(): the timer cancelled, the file removed
    read_backstop(log_dir, 1)   # the reporting rank: (step, phase, stacks) or None

A rank stuck in a C call that keeps the GIL (an extension that forgot to release it, a
``ctypes.PyDLL`` call) stops every Python thread of its process, the watchdog's included: no
heartbeat, no stacks through the store. Two things still work there. ``faulthandler``'s timer
is a C thread that needs no GIL: re-armed on every heartbeat, it fires only when the heartbeats
stop, and writes the Python stack of every thread to this rank's file. And a page of the same
file is mapped into memory, where the training thread writes its step at the end of each step
("loop") and the long phases it enters (checkpoint, evaluation, compile, sample), with no system call: the file's
first line says where the rank was when it froze, to the step, while the last heartbeat may be a step
or a hundred older; the stacks below it say where inside the step.

The rank that writes the hang report reads the file of each silent rank from the shared
``<output_dir>/logs/``. On one node that is the same file; across nodes it needs a shared file
system, or the report names the file to look at on the frozen rank's host. ``faulthandler``'s
timer is one per process: a program that arms its own ``dump_traceback_later`` loses it to the
watchdog while ``fit()`` runs.
"""

from __future__ import annotations

import contextlib
import faulthandler
import mmap
import os
import re
import sys
import threading
import time
from pathlib import Path

__all__ = ["Backstop", "NO_BACKSTOP", "open_backstop", "read_backstop", "backstop_path", "backstop_after"]

#: Bytes of the mapped first line: "ddpkit: step <12 digits> phase <16 chars> armed <unix time>" padded, then "\n"
_HEAD = 80
#: Where the step, the phase and the time it was armed sit in that line.
_STEP = slice(13, 25)
_PHASE = slice(32, 48)
_ARMED = slice(55, 65)
#: The step, " phase ", the phase: what a step's end rewrites in one slice
_STEP_IN_LOOP = slice(_STEP.start, _PHASE.stop)
_LINE = re.compile(rb"ddpkit: step +(\d+) phase (\S+) +armed +(\d+) *\n")


def backstop_path(log_dir: Path, rank: int) -> Path:
    return Path(log_dir) / f"stacks-rank{rank}.txt"


def backstop_after(hang_timeout: float) -> float:
    """Seconds without a heartbeat before the dump: before the reporting rank counts the rank silent
    (``SILENT_AFTER``, 10 s) and before it reports (``hang_timeout``), yet several heartbeats long."""
    return max(1.0, 0.8 * min(10.0, hang_timeout))


def open_backstop(log_dir: Path, *, rank: int, hang_timeout: float, step: int) -> Backstop | _NoBackstop:
    """This rank's backstop, or one that does nothing when its file cannot be made (a read-only directory)."""
    try:
        backstop = Backstop.open(log_dir, rank=rank, after=backstop_after(hang_timeout), step=step)
        # Armed now, not at the first heartbeat: a rank that freezes before it has a dump too
        backstop.arm()
        return backstop
    except (OSError, ValueError) as exc:
        print(
            f"ddpkit: rank {rank}: no faulthandler backstop ({exc}); a rank frozen in C code will have no stack",
            file=sys.stderr,
        )
        return NO_BACKSTOP


class Backstop:
    """One rank's faulthandler timer and position page; see the module docstring."""

    def __init__(self, fd: int, page: mmap.mmap, path: Path, after: float):
        self.fd = fd
        self.page = page
        self.path = path
        self.after = after
        self._phases: dict[str, bytes] = {}
        # Arm (watchdog thread) and close (training thread) may race
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def open(cls, log_dir: Path, *, rank: int, after: float, step: int) -> Backstop:
        path = backstop_path(log_dir, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, (b"ddpkit: step %12d phase %-16s armed %10d" % (step, b"setup", 0)).ljust(_HEAD - 1) + b"\n")
        page = mmap.mmap(fd, _HEAD)
        # faulthandler writes after the first line
        os.lseek(fd, _HEAD, os.SEEK_SET)
        return cls(fd, page, path, after)

    # --- the training thread: slice writes into the mapped page, no system call ----------------------

    def at_step(self, step: int) -> None:
        """Step ``step`` ended (or was resumed from): the page says that step, in the loop's own code."""
        # One write: the step and "loop"
        self.page[_STEP_IN_LOOP] = b"%12d phase loop            " % step

    def at_phase(self, phase: str) -> None:
        padded = self._phases.get(phase)
        if padded is None:
            padded = self._phases[phase] = phase.encode()[:16].replace(b" ", b"_").ljust(16)
        self.page[_PHASE] = padded

    # --- the watchdog thread ------------------------------------------------------------------------

    def arm(self) -> None:
        """Start the timer afresh (a heartbeat went out); a dump written while this rank lived is dropped."""
        with self._lock:
            if self._closed:
                return
            # Waits for a dump in progress to finish
            faulthandler.cancel_dump_traceback_later()
            # It fired, yet the watchdog runs again: not frozen after all
            if os.fstat(self.fd).st_size > _HEAD:
                os.ftruncate(self.fd, _HEAD)
                os.lseek(self.fd, _HEAD, os.SEEK_SET)
            # "armed <wall time>": when the heartbeats last ran
            self.page[_ARMED] = b"%10d" % int(time.time())
            faulthandler.dump_traceback_later(self.after, repeat=False, file=self.fd, exit=False)

    def close(self) -> None:
        """Cancel the timer (nothing stays armed after ``fit()``) and remove the file."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            faulthandler.cancel_dump_traceback_later()
            with contextlib.suppress(OSError):
                self.path.unlink()
            # The page stays mapped: the training thread may still write to it, harmlessly
            os.close(self.fd)


class _NoBackstop:
    """Before ``start()``, and when the file could not be made: the same calls, doing nothing."""

    def at_step(self, step: int) -> None: ...
    def at_phase(self, phase: str) -> None: ...
    def arm(self) -> None: ...
    def close(self) -> None: ...


NO_BACKSTOP = _NoBackstop()


def read_backstop(log_dir: Path, rank: int) -> tuple[int, str, str] | None:
    """``(step, phase, stacks)`` from rank ``rank``'s file: where it was, and faulthandler's dump
    ("" when the timer has not fired); None when there is no such file (another host's disk)."""
    try:
        data = backstop_path(log_dir, rank).read_bytes()
    except OSError:
        return None
    match = _LINE.match(data[:_HEAD])
    if match is None:
        return None
    dump = data[_HEAD:].decode(errors="replace").strip()
    if dump:
        armed = int(match.group(3))
        late = f"; its watchdog last ran at {time.strftime('%H:%M:%S', time.localtime(armed))}" if armed else ""
        # faulthandler's "Timeout (0:00:08)!"
        first, _, rest = dump.partition("\n")
        dump = (
            f"(written by faulthandler on rank {rank} itself: {first.strip()} its Python threads were frozen, "
            f"e.g. by a C call holding the GIL{late})\n{rest}"
        )
    return int(match.group(1)), match.group(2).decode(), dump
