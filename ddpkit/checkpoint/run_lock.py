"""One writer per run directory: global rank 0 holds ``<output_dir>/.ddpkit.lock`` while a run trains.

    with RunLock.for_run(config, runtime):      # every rank; rank 0 takes the lock, then all agree
        ...                                       # only now does anything write into output_dir
    holder = read_holder(Path("runs/quickstart"))   # who holds it, or None

A second run started on a directory a live run is writing into (the same ``run.name`` twice, a job
requeued while its old allocation still runs) is refused within seconds, before it writes or
resumes anything, with one line naming the holder and what to do; exit code 2
(:data:`~ddpkit.errors.EXIT_CONFIG`: not worth retrying). Without the lock the second run would
"resume" from the first one's checkpoint in progress and both would write the same files.

The lock file is created with ``O_CREAT | O_EXCL`` (atomic on local filesystems and on NFSv3+), and
holds the holder's host, pid, the process's start time (``/proc``) and a random token. Whether its
holder is still alive:

* on the same host: the pid is alive and started at the recorded time (a reused pid is not the holder);
* on another host (a shared filesystem): the file's modification time, which the holder refreshes
  every :data:`REFRESH_S` seconds from a daemon thread, is younger than :data:`STALE_AFTER_S`
  (three refreshes; assumes the hosts' clocks agree to within a few seconds).

A lock whose holder is dead (every process SIGKILLed, a node lost) is stale: the next run logs one
line naming it and takes it over, so the same command resumes. The lock is removed when the run
ends, however it ends short of SIGKILL, and only if it is still this run's (its token).

With ``checkpoint.dir`` on object storage (a URL), this lock still guards the local run directory (the
staging copy), and the store gets a lock of its own, a lease with fencing epochs, taken when the
remote mirror starts (:mod:`ddpkit.checkpoint.storage.lease`; same refusal, same exit code).

Before the lock, rank 0 checks that ``run.output_dir`` and ``checkpoint.dir`` can be written (judged
by their nearest existing folder; nothing is created): a path below a file or on a read-only mount is
refused at once with a ConfigError naming the key (exit 2), not found at the first save, hours in.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddpkit.distributed.processes import is_alive, proc_stat
from ddpkit.errors import EXIT_CONFIG, ConfigError, DdpkitError

# Annotations only: the store's upload process imports this module without torch
if TYPE_CHECKING:
    from ddpkit.config.schema import Config
    from ddpkit.distributed.process_group import Runtime

__all__ = [
    "LOCK_NAME",
    "REFRESH_S",
    "STALE_AFTER_S",
    "RunDirectoryLocked",
    "LockHolder",
    "RunLock",
    "cannot_write",
    "read_holder",
    "start_ticks",
]

log = logging.getLogger("ddpkit")

LOCK_NAME = ".ddpkit.lock"
#: Seconds between refreshes of the lock file's modification time (what other hosts judge liveness by).
REFRESH_S = 5.0
#: A lock from another host whose file has not been refreshed for this long belongs to a dead run.
STALE_AFTER_S = 3 * REFRESH_S


class RunDirectoryLocked(DdpkitError):
    """Another live run holds this run directory; exit code 2 (fix the command, do not retry it)."""

    exit_code = EXIT_CONFIG


@dataclass(frozen=True)
class LockHolder:
    """What a lock file says about the run that holds it, and how old its last refresh is."""

    host: str
    pid: int
    #: The pid's start time in /proc (clock ticks since boot): defeats pid reuse.
    start_ticks: str | None
    #: When it took the lock (Unix time).
    since: float
    token: str
    #: Seconds since the file was last refreshed.
    age_s: float

    def alive(self) -> bool:
        if self.host == socket.gethostname():
            return is_alive(self.pid) and (self.start_ticks is None or start_ticks(self.pid) == self.start_ticks)
        return self.age_s < STALE_AFTER_S

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        if not self.host:
            return f"a run starting there, lock file unreadable since {since}"
        return f"pid {self.pid} on {self.host}, since {since}"


def cannot_write(directory: Path) -> str | None:
    """Why this process cannot create or write ``directory``, else None; judged by its nearest existing folder,
    nothing created."""
    path = directory.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    if not path.is_dir():
        return f"{path} is a file, not a folder"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"{path} is not writable (permissions, or a read-only mount)"
    return None


def read_holder(directory: Path) -> LockHolder | None:
    """The holder named in ``directory``'s lock file, or None without one (an unreadable file: a holder of
    unknown pid)."""
    path = directory / LOCK_NAME
    age = 0.0
    try:
        age = time.time() - path.stat().st_mtime
        fields = json.loads(path.read_text())
        return LockHolder(
            str(fields["host"]),
            int(fields["pid"]),
            fields.get("start_ticks"),
            float(fields["since"]),
            str(fields["token"]),
            age,
        )
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        # Being written right now, or by a run killed while writing it
        return LockHolder("", 0, None, time.time() - age, "", age)


class RunLock:
    """The run directory's lock for one ``fit()`` (see the module docstring); a context manager on every rank."""

    def __init__(self, directory: Path | None, *, checkpoint_dir: Path | None = None):
        self.directory = directory
        self.checkpoint_dir = checkpoint_dir
        self.token = secrets.token_hex(8)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_run(cls, config: Config, runtime: Runtime) -> RunLock:
        """Rank 0 of the job checks the run's directories and locks ``config.output_dir``; the other ranks learn the
        outcome (a broadcast)."""
        if runtime.env.rank != 0:
            return cls(None)
        return cls(Path(config.output_dir), checkpoint_dir=Path(config.checkpoint_dir))

    def __enter__(self) -> RunLock:
        # Why this rank cannot go on: (locked by another run, message)
        refusal: tuple[bool, str] | None = None
        if self.directory is not None and (refusal := self._unwritable()) is None:
            try:
                self.acquire()
            except RunDirectoryLocked as exc:
                refusal = (True, str(exc))
        # Imported here: the store's upload process renews its lease through this module's helpers without torch.
        from ddpkit.distributed.collectives import broadcast_object

        # No rank writes before rank 0 holds the lock
        refusal = broadcast_object(refusal)
        if refusal is not None:
            locked, message = refusal
            error = RunDirectoryLocked(message) if locked else ConfigError(message)
            # Rank 0 prints the one line; the others exit quietly
            error.reported = self.directory is None
            raise error
        return self

    def _unwritable(self) -> tuple[bool, str] | None:
        """A refusal naming the first of ``run.output_dir`` / ``checkpoint.dir`` this process cannot write, else
        None."""
        for key, directory in (("run.output_dir", self.directory), ("checkpoint.dir", self.checkpoint_dir)):
            if directory is not None and (why := cannot_write(directory)):
                return False, (
                    f"{key}: cannot write to {directory}: {why}; point {key} at a directory this user can write"
                )
        return None

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def acquire(self) -> None:
        """Create the lock file (taking over a stale one), or raise :class:`RunDirectoryLocked` naming the holder."""
        assert self.directory is not None
        self.directory.mkdir(parents=True, exist_ok=True)
        # A takeover may race with another run's: try again, then refuse
        for _ in range(3):
            if self._create():
                self._start_refreshing()
                return
            holder = read_holder(self.directory)
            if holder is None:
                # Released meanwhile
                continue
            if holder.alive():
                raise RunDirectoryLocked(
                    f"run directory {self.directory} is in use by another run ({holder.describe()}): "
                    "give this run another run.name (or run.output_dir), or stop that run first"
                )
            log.warning(
                "ddpkit: taking over the stale lock of %s (%s is no longer running)", self.directory, holder.describe()
            )
            (self.directory / LOCK_NAME).unlink(missing_ok=True)
        raise RunDirectoryLocked(
            f"run directory {self.directory}: could not take its lock {LOCK_NAME}; is another run starting there?"
        )

    def _create(self) -> bool:
        assert self.directory is not None
        try:
            fd = os.open(self.directory / LOCK_NAME, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        fields = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "start_ticks": start_ticks(os.getpid()),
            "since": time.time(),
            "token": self.token,
        }
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(fields))
        return True

    def _start_refreshing(self) -> None:
        self._thread = threading.Thread(target=self._refresh, name="ddpkit-run-lock", daemon=True)
        self._thread.start()

    def _refresh(self) -> None:
        assert self.directory is not None
        while not self._stop.wait(REFRESH_S):
            try:
                os.utime(self.directory / LOCK_NAME)
            except OSError:
                # Removed by hand, or the filesystem is gone: the run goes on
                pass

    def release(self) -> None:
        """Stop refreshing and remove the lock file if it is still this run's."""
        self._stop.set()
        if self._thread is None or self.directory is None:
            return
        self._thread.join(timeout=1)
        self._thread = None
        holder = read_holder(self.directory)
        if holder is not None and holder.token == self.token:
            (self.directory / LOCK_NAME).unlink(missing_ok=True)


def start_ticks(pid: int) -> str | None:
    """Field 22 of ``/proc/PID/stat`` (the process's start time), or None without ``/proc``."""
    fields = proc_stat(pid)
    return fields[19] if fields is not None and len(fields) > 19 else None
