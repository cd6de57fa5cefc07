"""RemoteMirror: the run's checkpoints, metrics and final weights kept under a ``checkpoint.dir`` URL.

    mirror = RemoteMirror.for_run(config, runtime)   # every rank; None when checkpoint.dir is a local path
    mirror.fetch(config.checkpoint_dir)              # every rank, before the resume choice (a collective)
    mirror.protect(resumed_path)                     # the checkpoint this run resumed from: never deleted there
    mirror.saved(path)                               # after each committed local save: queued, returns at once
    mirror.metrics()                                 # {"remote_upload_s": ..., "remote_lag_steps": ...}
    mirror.drain()                                   # the end of training: metrics.jsonl, model.pt, the queue
    mirror.on_exit(status)                           # every rank, however it ends: hf/ if finished, drain, unlock

The run writes its checkpoints into the local staging folder ``config.checkpoint_dir``
(``<output_dir>/checkpoints``) exactly as without a URL, and the existing local discovery resumes from
it; this class only moves committed checkpoints out (in a background process, :mod:`.uploads`) and
the newest valid one back in (:meth:`fetch`). The run lock is taken on the store too (:mod:`.lease`).
"""

from __future__ import annotations

import logging
import re
import socket
from pathlib import Path
from typing import Any

from ddpkit.checkpoint.files import find_latest_checkpoint, list_checkpoints
from ddpkit.checkpoint.run_lock import RunDirectoryLocked
from ddpkit.checkpoint.storage.layout import RemoteCheckpoint, download, find_remote
from ddpkit.checkpoint.storage.lease import Lease, acquire, release
from ddpkit.checkpoint.storage.probe import probe_store, why, with_retries
from ddpkit.checkpoint.storage.store import Store
from ddpkit.checkpoint.storage.uploads import Uploader
from ddpkit.config.checks import hang_timeout_seconds
from ddpkit.config.schema import Config
from ddpkit.distributed.collectives import all_gather_object, broadcast_object
from ddpkit.distributed.env import DistEnv
from ddpkit.distributed.process_group import Runtime
from ddpkit.errors import CheckpointError, ConfigError, DdpkitError

__all__ = ["RemoteMirror", "EXIT_DEADLINE_S"]

log = logging.getLogger("ddpkit")

#: Seconds :meth:`RemoteMirror.drain` waits at most for the uploads still queued before it says what is left behind.
EXIT_DEADLINE_S = 600.0
_STEP = re.compile(r"^step-(\d{9})\.")
_RUN_FILES = ("metrics.jsonl", "model.pt")
#: The run's final Hugging Face directory (ddpkit.checkpoint.final_outputs.HF_DIRECTORY) and the files that make it
#: complete for a reader, uploaded last in this order: its index, then the config.json transformers reads first.
_HF_DIRECTORY, _HF_LAST = "hf", ("model.safetensors.index.json", "config.json")


class RemoteMirror:
    """One run's view of its ``checkpoint.dir`` URL (see the module docstring); built by :meth:`for_run`."""

    def __init__(
        self,
        store: Store,
        *,
        env: DistEnv,
        output_dir: Path,
        keep_last: int | None,
        lease: Lease | None,
        sharded: bool = False,
    ):
        self.store = store
        self.env = env
        self.output_dir = output_dir
        self.lease = lease
        nodes = max(1, env.world_size // max(1, env.local_world_size))
        self._node = env.rank // max(1, env.local_world_size)
        self._nodes = nodes if sharded else 1
        self._uploads = Uploader(
            {
                "url": store.url,
                "options": store.options,
                "keep_last": keep_last,
                "nodes": self._nodes,
                "lease": lease.__dict__ if lease is not None and env.rank == 0 else None,
            }
        )
        self._saved_step = self._remote_step = -1
        self._seconds = 0.0
        self._bytes = 0
        self._failures = 0
        self._told = False
        #: The local staging folder (``config.checkpoint_dir``), looked at once more at the end.
        self.staging: Path | None = None
        #: Seconds :meth:`drain` waits by default (for_run keeps it under the watchdog's checkpoint-phase limit),
        #: and :meth:`on_exit` (under its hang limit: a teardown is no checkpoint phase).
        self.deadline_s = self.exit_deadline_s = EXIT_DEADLINE_S

    @classmethod
    def for_run(cls, config: Config, runtime: Runtime, *, sharded: bool = False) -> RemoteMirror | None:
        """Probe the store from every node and take its lock on rank 0; None when ``checkpoint.dir`` is local.

        ``sharded``: the run's checkpoints are DCP directories (the layout says so: zero1, fsdp2, a pipeline).

        A collective. Every rank raises the same ConfigError (exit 2) when any node cannot use the store,
        and RunDirectoryLocked (exit 2) when another live run holds its lock.
        """
        url = config.checkpoint_url
        if url is None:
            return None
        env = runtime.env
        store = None
        problem = None
        if env.local_rank == 0 or env.rank == 0:
            try:
                store = probe_store(
                    url, dict(config.checkpoint.storage_options), host=socket.gethostname(), rank=env.rank
                )
            except ConfigError as exc:
                problem = str(exc)
        _raise_first(all_gather_object(problem), rank=env.rank, kind=ConfigError)
        store = store or Store(url, dict(config.checkpoint.storage_options))
        lease = _take_lock(store, rank=env.rank)
        mirror = cls(
            store,
            env=env,
            output_dir=Path(config.output_dir),
            keep_last=config.checkpoint.keep_last,
            lease=lease,
            sharded=sharded,
        )
        mirror.staging = Path(config.checkpoint_dir)
        # The watchdog's limit for a checkpoint: the waits for uploads below stay within it
        slow = config.dist.slow_phase_timeout or 0.9 * config.dist.timeout
        mirror.deadline_s = min(EXIT_DEADLINE_S, 0.8 * slow)
        mirror.exit_deadline_s = min(mirror.deadline_s, 0.5 * (hang_timeout_seconds(config.dist) or EXIT_DEADLINE_S))
        if env.rank == 0:
            # Renews the lock from now on
            mirror._uploads.start()
        return mirror

    # --- resume ---------------------------------------------------------------------------------

    def fetch(self, local_dir: str | Path) -> str | None:
        """Download the newest valid remote checkpoint ``local_dir`` lacks (each node once); its local path or None.

        A collective: each node's local rank 0 downloads and checks every object's sha256, the other
        ranks wait. A corrupt remote checkpoint is skipped with a warning for the next older one; a
        store that fails every retry ends every rank with one CheckpointError.
        """
        outcome: tuple[str | None, str | None] = (None, None)
        if self.env.local_rank == 0:
            try:
                outcome = (self._fetch_here(Path(local_dir)), None)
            except (OSError, CheckpointError, ValueError) as exc:
                outcome = (None, f"cannot fetch from {self.store.url} on {socket.gethostname()}: {why(exc)}")
        outcomes = all_gather_object(outcome)
        _raise_first([problem for _, problem in outcomes], rank=self.env.rank, kind=CheckpointError)
        return outcomes[0][0]

    def _fetch_here(self, local_dir: Path) -> str | None:
        local = find_latest_checkpoint(local_dir)
        for remote in with_retries(self._remote_checkpoints, self.store):
            if local is not None and local.step >= remote.step:
                # This disk already has it, or something newer
                return None
            try:
                path = with_retries(lambda: download(self.store, remote, local_dir), self.store)
            except CheckpointError as exc:
                log.warning("ddpkit: %s", exc)
                continue
            log.info("fetched %s (step %d) from %s", remote.name, remote.step, self.store.url)
            self._fetch_run_files()
            return str(path)
        return None

    def _remote_checkpoints(self) -> list[RemoteCheckpoint]:
        return [c for c in find_remote(self.store) if c.name.startswith("step-")]

    def _fetch_run_files(self) -> None:
        """``metrics.jsonl`` comes back too where this disk has none, so the resumed run appends to the whole record."""
        target = self.output_dir / "metrics.jsonl"
        if self.env.rank == 0 and not target.exists() and (data := self.store.get_bytes("metrics.jsonl")) is not None:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)

    # --- saves ----------------------------------------------------------------------------------

    def protect(self, path: str | Path) -> None:
        """Never delete ``path``'s checkpoint on the store (the one this run resumed from); every rank may call it."""
        if self._uploads_here(Path(path)):
            self._uploads.submit({"op": "protect", "name": Path(path).name})

    def saved(self, path: str | Path, *, step: int | None = None) -> None:
        """Queue the upload of the checkpoint just committed at ``path`` and return at once.

        Call on each rank that wrote: rank 0 for a file, every rank for a sharded ``.dcp`` (each node's
        local rank 0 sends its node's shards; the others return at once). Under ``checkpoint.async`` call it
        right after queueing the write: the upload waits for the local manifest of ``step``. ``step`` is read
        from a ``step-*`` name; give it for a named checkpoint ("best").
        """
        path = Path(path)
        if not self._uploads_here(path):
            return
        step = _step_of(path) if step is None else step
        ranks = list(
            range(self.env.rank - self.env.local_rank, self.env.rank - self.env.local_rank + self.env.local_world_size)
        )
        self._uploads.submit(
            {
                "op": "checkpoint",
                "path": str(path),
                "step": step,
                "node": self._node if self._nodes > 1 else 0,
                "nodes": self._nodes,
                "ranks": ranks,
            }
        )
        if path.name.startswith("step-"):
            self._saved_step = max(self._saved_step, step)
        if self.env.rank == 0:
            self._queue_run_files(("metrics.jsonl",))

    def _queue_newer_local(self) -> None:
        """A checkpoint written without :meth:`saved` (the crash save of a dead peer's last step) goes up too."""
        if self.staging is None:
            return
        # Listed with their sizes checked, without hashing them
        local = [c for c in list_checkpoints(self.staging) if c.path.suffix == ".pt"]
        if local and local[-1].step > self._saved_step:
            self.saved(local[-1].path, step=local[-1].step)

    def _uploads_here(self, path: Path) -> bool:
        return self.env.rank == 0 or (path.suffix == ".dcp" and self.env.local_rank == 0 and self._nodes > 1)

    def _queue_run_files(self, names: tuple[str, ...]) -> None:
        for name in names:
            if (self.output_dir / name).is_file():
                self._uploads.submit(
                    {"op": "file", "path": str(self.output_dir / name), "name": name, "lines": name.endswith(".jsonl")}
                )

    # --- reporting and the end ------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        """Upload seconds (the last one), bytes sent, steps the remote copy lags the last save, failed uploads."""
        self._count(self._uploads.answers())
        lag = max(0, self._saved_step - max(self._remote_step, 0)) if self._saved_step >= 0 else 0
        return {
            "remote_upload_s": round(self._seconds, 3),
            "remote_upload_bytes": self._bytes,
            "remote_lag_steps": lag,
            "remote_upload_failures": self._failures,
        }

    def _count(self, answers: list[dict[str, Any]]) -> None:
        for answer in answers:
            if not answer.get("ok"):
                self._failures += 1
                continue
            self._bytes += int(answer.get("bytes") or 0)
            if str(answer.get("name", "")).startswith("step-") and not answer.get("skipped"):
                self._seconds = float(answer.get("seconds") or 0.0)
                self._remote_step = max(self._remote_step, int(answer.get("step") or 0))

    def drain(self, deadline_s: float | None = None) -> list[str]:
        """Upload ``metrics.jsonl`` and ``model.pt`` too, then wait for everything queued, at most ``deadline_s``
        seconds (default :attr:`deadline_s`); the paths left behind, named in one warning. Not a collective.

        Call it at the end of training inside the checkpoint phase (the watchdog allows that phase longer),
        so a long last upload is not taken for a hang. It may be called again: :meth:`on_exit` does, for what
        was written after it (``model.pt``).
        """
        deadline_s = self.deadline_s if deadline_s is None else deadline_s
        if self.env.rank == 0:
            self._queue_newer_local()
            self._queue_run_files(_RUN_FILES)
        answers, left = self._uploads.drain(deadline_s)
        self._count(answers)
        undone = [job.get("path", "") for job in left]
        if undone:
            log.warning(
                "ddpkit: %d upload(s) to %s not finished within %.0f s, kept only locally: %s",
                len(undone),
                self.store.url,
                deadline_s,
                ", ".join(undone),
            )
        elif self._failures and not self._told:
            self._told = True
            log.warning(
                "ddpkit: %d upload(s) to %s failed during the run (see the warnings above)",
                self._failures,
                self.store.url,
            )
        return undone

    def on_exit(self, status: str = "finished", *, deadline_s: float | None = None) -> list[str]:
        """The run's end however it ends (a listener's teardown): upload what is left (``model.pt``; ``hf/`` when
        the run finished, so a stopped or failed run leaves the store's copy as it was), at most ``deadline_s``
        seconds (default :attr:`exit_deadline_s`), and release the store's lock.

        Returns the paths whose upload was left behind. Then the lock is not released (the store is likely
        unreachable): it expires by itself, LEASE_S after the last renewal.
        """
        directory = self.output_dir / _HF_DIRECTORY
        if self.env.rank == 0 and status.upper() == "FINISHED" and directory.is_dir():
            # Written at the end of training, after the last drain; only here, so it goes up once
            job = {"op": "directory", "path": str(directory), "name": _HF_DIRECTORY, "last": list(_HF_LAST)}
            self._uploads.submit(job)
        left = self.drain(self.exit_deadline_s if deadline_s is None else deadline_s)
        if self.lease is not None and not left:
            try:
                release(self.store, self.lease)
            except Exception as exc:
                # The lease simply expires
                log.warning("ddpkit: could not release the lock on %s (run %s): %s", self.store.url, status, why(exc))
        return left


def _take_lock(store: Store, *, rank: int) -> Lease | None:
    """Rank 0 takes the store's lock; every rank learns a refusal (one broadcast) and raises it."""
    # Refusal: (held by another run, the line that says so)
    lease = None
    refusal = None
    if rank == 0:
        if not store.conditional:
            log.warning(
                "ddpkit: WARNING: %s does not refuse a second create-only write (no conditional writes): the run "
                "lock there is best effort, and two runs started at the same moment could both write",
                store.url,
            )
        try:
            lease = with_retries(lambda: acquire(store), store)
        except RunDirectoryLocked as exc:
            refusal = (True, str(exc))
        except Exception as exc:
            # The store failed every try: every rank must hear it, not wait in the broadcast
            refusal = (False, f"checkpoint.dir={store.url}: cannot take the run lock there: {why(exc)}")
    locked, message = broadcast_object(refusal) or (True, None)
    _raise_first([message], rank=rank, kind=RunDirectoryLocked if locked else CheckpointError)
    return lease


def _step_of(path: Path) -> int:
    match = _STEP.match(path.name)
    if match:
        return int(match.group(1))
    import json

    # A named checkpoint ("best") has no step in its name: its manifest says it
    return int(json.loads(path.with_suffix(".json").read_text())["step"])


def _raise_first(problems: list[str | None], *, rank: int, kind: type[DdpkitError]) -> None:
    """Raise the first problem any rank met on every rank; rank 0 prints it, the others exit quietly."""
    problem = next((p for p in problems if p is not None), None)
    if problem is not None:
        error = kind(problem)
        error.reported = rank != 0
        raise error
