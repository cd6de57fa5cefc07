"""The upload process: ``python -m ddpkit.checkpoint.storage.worker``, started by :class:`.uploads.Uploader`.

A fresh interpreter (the ``spawn`` way, never ``fork``: an fsspec client copied by fork can hang), so
no upload ever holds the training process's GIL, memory or collectives. It reads one JSON line of
settings, then one job per line on stdin, and answers one JSON line per job on stdout:

    {"op": "checkpoint", "seq": 4, "path": "runs/x/checkpoints/step-000000200.pt", "step": 200}
    -> {"seq": 4, "ok": true, "name": "step-000000200.pt", "step": 200, "bytes": 41234, "seconds": 0.8}

One upload at a time, in order; when several checkpoints queued up behind a slow one, only the
newest is sent (the older ones would be retired right after). Each job is retried with exponential
backoff (1, 2, 4 ... 30 s; up to ATTEMPTS tries within RETRY_S), on a rebuilt client each time (expired
credentials, a dropped connection); a job that still fails is warned about on stderr and answered
``"ok": false``: a failing store never stops training. The process renews the run's lock on the store
every RENEW_S seconds and exits when its parent does (or at the ``exit`` job, after the queue is done).
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddpkit.checkpoint.storage.lease import RENEW_S, Lease, renew
from ddpkit.checkpoint.storage.publish import (
    LeaseLost,
    NotRetried,
    Superseded,
    newer_committed,
    publish_checkpoint,
    publish_directory,
    publish_file,
)
from ddpkit.checkpoint.storage.store import Store
from ddpkit.errors import first_line

__all__ = ["Worker", "ATTEMPTS", "RETRY_S", "BACKOFF_S", "BACKOFF_MAX_S", "main"]

#: Tries per upload before it is given up (and counted as a failure)...
ATTEMPTS = 10
#: ... or once this many seconds have passed since its first try: a store away for a few minutes loses no upload.
RETRY_S = 300.0
#: The first retry's wait in seconds; each next one doubles it, up to BACKOFF_MAX_S.
BACKOFF_S = 1.0
BACKOFF_MAX_S = 30.0


class Worker:
    """Runs upload jobs against a store, with retries; the loop around it is :func:`main` (or a test)."""

    def __init__(
        self,
        store: Store,
        *,
        epoch: int | None = None,
        keep_last: int | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.store = store
        self.epoch = epoch
        self.keep_last = keep_last
        self.sleep = sleep
        self.protected: set[str] = set()
        self.renew_failing = False

    def handle(self, job: dict[str, Any]) -> dict[str, Any] | None:
        """Run one job; the answer for the parent (None for bookkeeping jobs such as ``protect``)."""
        if job["op"] == "protect":
            self.protected.add(job["name"])
            return None
        started = time.monotonic()
        error = None
        attempts = 0
        for attempts in range(1, ATTEMPTS + 1):
            try:
                if job["op"] == "checkpoint":
                    done = publish_checkpoint(
                        self.store, job, epoch=self.epoch, keep_last=self.keep_last, protected=self.protected
                    )
                elif job["op"] == "directory":
                    done = publish_directory(self.store, job)
                else:
                    done = publish_file(self.store, job)
                return {"seq": job.get("seq"), "ok": True, "seconds": round(time.monotonic() - started, 3), **done}
            except Superseded:
                # Pruned locally once a newer checkpoint was saved: that one goes up instead
                return {"seq": job.get("seq"), "ok": True, "skipped": True, "step": job.get("step"), "bytes": 0}
            except NotRetried as exc:
                # The lock was lost, or the local save never completed
                return self._failed(job, exc, attempts, started)
            except FileNotFoundError as exc:
                # The local file is gone (pruned mid-upload), or the store has no bucket
                if job["op"] == "checkpoint" and newer_committed(Path(job["path"]), job["step"]):
                    return {"seq": job.get("seq"), "ok": True, "skipped": True, "step": job.get("step"), "bytes": 0}
                if job["op"] != "checkpoint" or not os.path.exists(job["path"]):
                    return self._failed(job, exc, attempts, started)
                error = exc
            except Exception as exc:
                # Throttling, timeouts, expired credentials, a server that went away
                error = exc
            if attempts < ATTEMPTS and time.monotonic() - started < RETRY_S:
                self.sleep(min(BACKOFF_MAX_S, BACKOFF_S * 2 ** (attempts - 1)))
                self._rebuild()
            else:
                break
        return self._failed(job, error, attempts, started)

    def _rebuild(self) -> None:
        try:
            # New client: credentials read again
            self.store.rebuild()
        except Exception as exc:
            print(
                f"ddpkit: upload: cannot rebuild the {self.store.scheme} client: {first_line(exc)}",
                file=sys.stderr,
                flush=True,
            )

    def _failed(self, job: dict[str, Any], exc: BaseException | None, attempts: int, started: float) -> dict[str, Any]:
        what = job.get("path", job.get("name"))
        why = first_line(exc) if exc is not None else "unknown error"
        print(
            f"ddpkit: warning: could not upload {what} to {self.store.url} after {attempts} attempt(s): {why}; "
            "training goes on, the local copy stays",
            file=sys.stderr,
            flush=True,
        )
        return {
            "seq": job.get("seq"),
            "ok": False,
            "error": why,
            "name": os.path.basename(str(what)),
            "step": job.get("step"),
            "seconds": round(time.monotonic() - started, 3),
            "lease_lost": isinstance(exc, LeaseLost),
        }

    def renew(self, lease: Lease) -> bool:
        """One renewal of the store's lock; False when it is lost (then warned about once, by the caller)."""
        try:
            held = renew(self.store, lease)
        except Exception as exc:
            # A store that is away for a while: warned once; the lease lives until LEASE_S
            if not self.renew_failing:
                print(
                    f"ddpkit: warning: cannot renew the lock on {self.store.url}: {first_line(exc)}; retrying",
                    file=sys.stderr,
                    flush=True,
                )
            self.renew_failing = True
            return True
        if self.renew_failing:
            print(f"ddpkit: the lock on {self.store.url} is renewed again", file=sys.stderr, flush=True)
        self.renew_failing = False
        return held


def coalesce(jobs: list[dict[str, Any]], *, in_parts: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(to run, superseded)``: of several queued checkpoint jobs only the newest runs (not when nodes
    share the work of one checkpoint: node 0 would wait for a part another node skipped)."""
    checkpoints = [
        j for j in jobs if j["op"] == "checkpoint" and str(j.get("path", "")).rsplit("/", 1)[-1].startswith("step-")
    ]
    if in_parts or len(checkpoints) < 2:
        return jobs, []
    skipped = checkpoints[:-1]
    return [j for j in jobs if j not in skipped], skipped


def _read_jobs(jobs: queue.Queue) -> None:
    for line in sys.stdin:
        if line.strip():
            jobs.put(json.loads(line))
    # The parent closed the pipe: finish the queue, then stop
    jobs.put({"op": "exit"})


def _renewing(worker: Worker, lease: Lease, stop: threading.Event) -> None:
    while not stop.wait(RENEW_S):
        if not worker.renew(lease):
            print(
                f"ddpkit: warning: the lock on {worker.store.url} was taken over by another run; "
                "this run's checkpoints no longer count there",
                file=sys.stderr,
                flush=True,
            )
            return


def main() -> None:
    # Answers only; anything a library prints goes to stderr
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    try:
        # The training process comes first for the CPU (hashing, TLS, the client's own work)
        os.nice(10)
    except OSError:
        pass
    spec = json.loads(sys.stdin.readline())
    lease = Lease(**spec["lease"]) if spec.get("lease") else None
    worker = Worker(
        Store(spec["url"], spec.get("options")), epoch=lease.epoch if lease else None, keep_last=spec.get("keep_last")
    )
    jobs: queue.Queue = queue.Queue()
    threading.Thread(target=_read_jobs, args=(jobs,), name="ddpkit-upload-jobs", daemon=True).start()
    stop = threading.Event()
    if lease is not None:
        threading.Thread(target=_renewing, args=(worker, lease, stop), name="ddpkit-lease", daemon=True).start()
    parent = spec["ppid"]
    backlog = []
    exiting = False
    while not (exiting and not backlog):
        if os.getppid() != parent:
            # The trainer is gone (killed): stop, and stop renewing its lock
            return
        try:
            backlog.append(jobs.get(timeout=0.0 if backlog else 1.0))
            # Gather everything queued before choosing
            continue
        except queue.Empty:
            pass
        exiting = exiting or any(j["op"] == "exit" for j in backlog)
        backlog = [j for j in backlog if j["op"] != "exit"]
        run, skipped = coalesce(backlog, in_parts=spec.get("nodes", 1) > 1)
        for job in skipped:
            out.write(
                json.dumps({"seq": job.get("seq"), "ok": True, "skipped": True, "step": job.get("step"), "bytes": 0})
                + "\n"
            )
        if run:
            job = run[0]
            backlog = run[1:]
            if (answer := worker.handle(job)) is not None:
                out.write(json.dumps(answer) + "\n")
        out.flush()
    stop.set()


if __name__ == "__main__":
    main()
