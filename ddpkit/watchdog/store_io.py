"""The watchdog's plumbing: store calls with a deadline, torchrun's error file, exiting from a thread.

    client = StoreClient(dist.PrefixStore("ddpkit/watchdog/1", own_client(store)), deadline=5.0)
    client("set", "hb/0", "...")                  # raises StoreDown after 5 s with no answer
    client.get_if_set("alarm")                    # None when the key does not exist; never blocks on it

Every value the client sets carries a tag made with the job's key, and every value it reads must
carry a valid one (:mod:`ddpkit.distributed.control_auth`): a value someone else wrote to the store
reads as missing (and the first of each kind of key is logged); a ``compare_set`` that finds one
replaces it.

Kept apart from :mod:`ddpkit.watchdog.heartbeat` so that module reads as the protocol alone.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddpkit.atomic import write_atomically
from ddpkit.distributed.control_auth import job_key, read_signed, sign
from ddpkit.distributed.processes import proc_stat
from ddpkit.errors import exit_now, first_line

__all__ = [
    "StoreClient",
    "StoreDown",
    "own_client",
    "write_text",
    "write_error_file",
    "kill_frozen_sibling",
    "process_gone",
    "terminate",
]


class StoreDown(RuntimeError):
    """The store did not answer in time, or the connection failed."""


class StoreClient:
    """Store calls on a daemon thread, each with a deadline (a TCPStore call to a frozen server blocks forever).

    :meth:`close` ends the thread before the process group goes: a daemon thread still inside a
    store call when the interpreter shuts down is ended (``pthread_exit``) as it takes the GIL back,
    and the C++ frames it unwinds through turn that into ``std::terminate`` (SIGABRT).
    """

    def __init__(self, store: Any, deadline: float, *, key: bytes | None = None):
        self.store = store
        self.deadline = deadline
        # Read once: the tag of every value set and read
        self.key = key if key is not None else job_key()
        self._requests: list[tuple[Callable[..., Any], tuple[Any, ...], list[Any], threading.Event]] = []
        self._wake = threading.Condition()
        self._idle = threading.Event()
        self._idle.set()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="ddpkit-watchdog-store", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            with self._wake:
                while not self._requests and not self._closed:
                    self._wake.wait()
                if not self._requests:
                    # Closed, nothing left to send
                    return
                fn, args, box, done = self._requests.pop(0)
            try:
                box.append((True, fn(*args)))
            except Exception as exc:
                # DistStoreError, connection reset, ...: handed back to the caller
                box.append((False, exc))
            # Before done: the caller's next call must find the line free
            self._idle.set()
            done.set()

    def __call__(self, method: str, *args: Any) -> Any:
        """``store.<method>(*args)`` within the deadline; values set are signed, values read verified (see the
        module docstring).

        ``get`` and ``multi_get`` give None for a value without a valid tag; ``compare_set`` gives the
        winning value, verified."""
        if method == "set":
            name, value = args
            return self._call("set", name, sign(self.key, name, value))
        if method == "get":
            return self._verified(args[0], self._call("get", args[0]))
        if method == "multi_get":
            return [self._verified(name, raw) for name, raw in zip(args[0], self._call("multi_get", args[0]))]
        if method == "compare_set":
            return self._compare_set(*args)
        return self._call(method, *args)

    def _verified(self, name: str, raw: bytes) -> bytes | None:
        value = read_signed(self.key, name, raw)
        return None if value is None else value.encode()

    def _compare_set(self, name: str, expected: str, desired: str) -> bytes:
        """Set ``name`` to ``desired`` unless it holds a valid value already; the value it ends with, verified.

        A value without a valid tag counts as absent and is replaced: a forged alarm must not keep
        the real one out. (ddpkit only claims keys that are absent: ``expected`` is "".)
        """
        assert expected == "", "the watchdog only claims keys that do not exist yet"
        signed = sign(self.key, name, desired)
        current = self._call("compare_set", name, "", signed)
        # Someone who keeps writing there gets no more tries than this
        for _ in range(3):
            if (value := self._verified(name, current)) is not None:
                return value
            current = self._call("compare_set", name, current, signed)
        raise StoreDown(f"{name!r} keeps being overwritten with values without a valid tag")

    def _call(self, method: str, *args: Any) -> Any:
        if self._closed:
            raise StoreDown("the watchdog's store client is closed")
        if not self._idle.is_set():
            raise StoreDown("an earlier store call is still waiting for an answer")
        box: list[Any] = []
        done = threading.Event()
        self._idle.clear()
        with self._wake:
            self._requests.append((getattr(self.store, method), args, box, done))
            self._wake.notify()
        if not done.wait(self.deadline):
            raise StoreDown(f"no answer from the store within {self.deadline:g}s")
        ok, value = box[0]
        if not ok:
            raise StoreDown(f"{type(value).__name__}: {first_line(value)}")
        return value

    def get_if_set(self, key: str) -> str | None:
        """The value of ``key``, or None when it does not exist or has no valid tag (never blocks on a missing key)."""
        if not self("check", [key]):
            return None
        value = self("get", key)
        return None if value is None else value.decode()

    def close(self) -> None:
        """End the thread once the call in flight, if any, has returned (waits at most the deadline)."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(self.deadline)


def own_client(store: Any) -> Any:
    """A second connection to ``store`` for the watchdog's thread, so it never waits on the training thread's lock."""
    try:
        return store.clone()
    except (AttributeError, RuntimeError):
        return store


def write_text(path: Path, text: str) -> Path:
    """Write a report atomically; a failure is printed (the report itself went to the log already)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, text)
    except OSError as exc:
        print(f"ddpkit: could not write {path} ({exc}); the report is printed above", file=sys.stderr, flush=True)
    return path


def write_error_file(
    message: str, *, when: float, code: int, local_rank: int | None = None, pid: int | None = None
) -> None:
    """torchrun's error file: its summary names the failure with the earliest timestamp first.

    ``code`` (the exit code this rank is about to leave with) and the pid are recorded too: with
    forked workers torch's launcher observes only the first rank it sees exit, and
    :func:`ddpkit.launch.launcher.launch` reads the other ranks' failures from these files.
    With ``local_rank`` and ``pid``: the file of a frozen rank of this node, written for it before it is killed.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    # torchrun's attempt_N/<local_rank>/error.json
    if local_rank is not None:
        path = str(Path(path).parent.parent / str(local_rank) / Path(path).name)
    info = {"py_callstack": message, "timestamp": str(int(when)), "exitcode": code, "pid": pid or os.getpid()}
    payload = {"message": {"message": message, "extraInfo": info}}
    try:
        with open(path, "w") as f:
            json.dump(payload, f)
    except OSError:
        pass


def kill_frozen_sibling(pid: int) -> bool:
    """SIGKILL ``pid`` if it is a rank of this node's job: a child of our parent (torchrun's agent).

    A SIGSTOPped or otherwise frozen rank ignores the agent's SIGTERM until the agent's shutdown
    timeout ends in SIGKILL; the job's end should not wait for that. The parent check guards
    against a reused pid.
    """
    try:
        fields = proc_stat(pid)
        if fields is None or int(fields[1]) != os.getppid() or pid == os.getpid():
            return False
        os.kill(pid, signal.SIGKILL)
        return True
    except (OSError, ValueError, IndexError):
        return False


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (exited, or a zombie its parent has not reaped yet); False where /proc
    cannot tell."""
    if not os.path.exists("/proc/self/stat"):
        return False
    fields = proc_stat(pid)
    return fields is None or fields[0] in ("Z", "X")


def terminate(code: int, *, stop_children: Callable[[Any], None] = lambda child: child.kill()) -> None:
    """Exit now, without the interpreter's teardown (it would wait for threads that never end).

    Child processes (DataLoader workers) are stopped first, since nothing else would reap them
    (killed by default: from the watchdog thread the main thread is stuck), and output is flushed.
    """
    for child in multiprocessing.active_children():
        stop_children(child)
    exit_now(code)
