"""Processes on this host, read from ``/proc``: the one parser of ``/proc/PID/stat``.

    fields = proc_stat(pid)        # ['S', '1234', ...]: state, parent pid, ... (None: gone, or no /proc)
    alive = is_alive(pid)          # running or sleeping, not a zombie

Used to find live ranks without collectives (the crash save), to date a process's start (the
goodput ledger) and to check a frozen sibling before killing it (the hang watchdog).
"""

from __future__ import annotations

import os

__all__ = ["proc_stat", "is_alive"]


def proc_stat(pid: int | str = "self") -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state first, then the parent's pid, ...),
    or None where the process or ``/proc`` is not there. The name, in parentheses, may hold spaces."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def is_alive(pid: object) -> bool:
    """Whether process ``pid`` exists on this host and is not a zombie (dead, not yet reaped).

    Another user's live process counts as alive; anything that is not a positive pid is not."""
    try:
        # A pid read from a file may be text or None.
        pid = int(pid)  # type: ignore[call-overload]
        # 0 and -1 would signal whole process groups.
        if pid <= 0:
            return False
        os.kill(pid, 0)
    except (TypeError, ValueError, OverflowError, ProcessLookupError):
        return False
    except PermissionError:
        # Someone else's process: alive.
        return True
    fields = proc_stat(pid)
    # No /proc: os.kill's answer stands.
    return fields is None or fields[0] not in ("Z", "X")
