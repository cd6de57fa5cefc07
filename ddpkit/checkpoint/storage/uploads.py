"""The training process's handle on its upload process: queue a job and return, read answers, drain at the end.

    uploads = Uploader({"url": "s3://b/run", "options": {}, "keep_last": 2, "lease": None})
    uploads.submit({"op": "checkpoint", "path": "runs/x/checkpoints/step-000000200.pt", "step": 200})  # returns at once
    uploads.answers()          # the answers that arrived since the last call (never blocks)
    left = uploads.drain(60)   # at the end: the jobs not done within 60 s (the process is then stopped)

The process is a new interpreter running :mod:`ddpkit.checkpoint.storage.worker` without torch
(:data:`BOOT`), started by :meth:`Uploader.start` or the first job; jobs and answers are JSON lines on its
stdin and stdout. Submitting writes one short line into a pipe the process always reads, so it never waits
for an upload. No thread runs in the training process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["Uploader", "BOOT"]

# ``python -m ddpkit.checkpoint.storage.worker`` would run ddpkit/__init__.py first, which imports the Trainer and
# torch: seconds of CPU and hundreds of MB per upload process for nothing it uses. The packages on the way are
# registered empty instead, so only the modules the worker needs are loaded (fsspec, its backend, a few of ours).
BOOT = """import os, runpy, sys, types
root = sys.argv.pop(1)
for name in ("ddpkit", "ddpkit.config", "ddpkit.distributed", "ddpkit.checkpoint", "ddpkit.checkpoint.storage"):
    package = types.ModuleType(name)
    package.__path__ = [os.path.join(root, *name.split("."))]
    sys.modules[name] = package
runpy.run_module("ddpkit.checkpoint.storage.worker", run_name="__main__", alter_sys=True)
"""


class Uploader:
    """One upload process and the jobs it has not answered yet."""

    def __init__(self, spec: dict[str, Any]):
        self.spec = spec
        # seq -> job, until answered
        self.pending: dict[int, dict[str, Any]] = {}
        self._proc: subprocess.Popen | None = None
        self._seq = 0
        self._buffer = b""

    def start(self) -> None:
        """Start the process now (it renews the lock from then on); otherwise the first submit does."""
        if self._proc is not None:
            return
        env = dict(os.environ)
        # A checkout that is not installed works too
        package_root = str(Path(__file__).resolve().parents[3])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        env.setdefault("OMP_NUM_THREADS", "1")
        self._proc = subprocess.Popen(
            [sys.executable, "-c", BOOT, package_root],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            close_fds=True,
        )
        os.set_blocking(self._proc.stdout.fileno(), False)
        self._send({**self.spec, "ppid": os.getpid()})

    def submit(self, job: dict[str, Any]) -> None:
        """Queue ``job``; returns at once. A process that died is started again (and its lost jobs reported failed)."""
        if self._proc is not None and self._proc.poll() is not None:
            # Died (killed, out of memory): what it had not answered is lost
            self._proc = None
        self.start()
        self._seq += 1
        job = {**job, "seq": self._seq}
        if job["op"] != "protect":
            self.pending[self._seq] = job
        self._send(job)

    def answers(self) -> list[dict[str, Any]]:
        """The answers that arrived since the last call, without waiting."""
        if self._proc is None:
            return []
        try:
            while chunk := os.read(self._proc.stdout.fileno(), 1 << 16):
                self._buffer += chunk
        except BlockingIOError:
            pass
        *lines, self._buffer = self._buffer.split(b"\n")
        answers = [json.loads(line) for line in lines if line.strip()]
        for answer in answers:
            self.pending.pop(answer.get("seq"), None)
        return answers

    def drain(self, deadline_s: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Let the queued jobs finish, at most ``deadline_s`` seconds: ``(answers, jobs left undone)``."""
        if self._proc is None:
            return [], []
        try:
            # End of jobs: the process finishes its queue and exits
            self._proc.stdin.close()
        except OSError:
            pass
        answers = []
        end = time.monotonic() + deadline_s
        while self._proc.poll() is None and time.monotonic() < end:
            answers += self.answers()
            time.sleep(0.05)
        if self._proc.poll() is None:
            # Past the deadline: what is still uploading stays local
            self._proc.kill()
        self._proc.wait()
        answers += self.answers()
        left = list(self.pending.values())
        self.pending.clear()
        self._proc.stdout.close()
        self._proc = None
        return answers, left

    def _send(self, message: dict[str, Any]) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        try:
            self._proc.stdin.write((json.dumps(message) + "\n").encode())
            self._proc.stdin.flush()
        except BrokenPipeError:
            # The process just died; the next submit starts another
            pass
