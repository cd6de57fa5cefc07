"""Crash-safe checkpoint files: write, validate, find the newest good one, load safely.

A checkpoint is two files in the checkpoint directory::

    step-000001200.pt     the state dict (torch.save)
    step-000001200.json   its manifest: size, SHA-256, step, versions; written last

Writing never leaves a half-written file under a final name: data goes to a hidden temporary
file in the same directory, is flushed and fsynced, renamed with ``os.replace`` (atomic), and the
directory is fsynced; the manifest follows the same way. A checkpoint counts only when its
manifest exists and the data file matches the manifest's size and checksum, so a crash at any
point leaves either the previous checkpoints or the new one, never a corrupt "latest".
Temporary files of a killed write are removed by the next save; old checkpoints beyond
``keep_last`` are removed only after the new one is complete. A write that fails (a full disk)
removes what it wrote, keeps every earlier checkpoint, and raises one :class:`CheckpointError` line
naming the checkpoint, the directory, the space needed and free, and the newest complete
checkpoint (:mod:`ddpkit.checkpoint.disk_space`); a save that will not fit is warned about first.

Discovery skips, with a warning naming it, any ``step-*`` file that is not a complete checkpoint
(no manifest, truncated, corrupt, foreign, unreadable); the newest valid one is used.

Loading always uses ``torch.load(..., weights_only=True)``: a file carrying a pickle payload
that would run code is refused and the code does not run.

This module reads and writes state dicts; it knows nothing of the Trainer.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ddpkit.atomic import file_sha256, write_atomically
from ddpkit.checkpoint.components import StateTree
from ddpkit.checkpoint.disk_space import room_check, state_bytes, write_failure
from ddpkit.checkpoint.staging import HostStaging
from ddpkit.errors import CheckpointError

__all__ = [
    "CheckpointInfo",
    "checkpoint_path",
    "save_checkpoint",
    "load_checkpoint",
    "validate_checkpoint",
    "list_checkpoints",
    "find_latest_checkpoint",
    "resolve_resume_path",
    "AsyncCheckpointWriter",
    "save_atomically",
]

log = logging.getLogger("ddpkit")

FORMAT_VERSION = 1
#: .dcp: a sharded checkpoint directory (checkpoint/sharded.py)
_STEP_FILE = re.compile(r"^step-(\d{9})\.(?:pt|dcp)$")


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint on disk: its data file, its manifest path and the manifest's content."""

    path: Path
    manifest: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.manifest["step"])


def checkpoint_path(directory: str | os.PathLike, *, step: int, name: str | None = None, suffix: str = ".pt") -> Path:
    """Where the checkpoint of ``step`` (or the one named ``name``, e.g. "best") lives in ``directory``: the one naming
    rule for single files (``.pt``), sharded directories (``.dcp``) and their copies in a store."""
    return Path(directory) / f"{name or f'step-{step:09d}'}{suffix}"


def manifest_path(path: Path) -> Path:
    return path.with_suffix(".json")


def save_checkpoint(
    state: dict[str, Any],
    directory: str | os.PathLike,
    *,
    step: int,
    name: str | None = None,
    keep_last: int | None = None,
    meta: dict[str, Any] | None = None,
) -> CheckpointInfo:
    """Write ``state`` crash-safely as ``step-<step>.pt`` (or ``<name>.pt``) plus its manifest.

    Args:
        state: a state dict of tensors, numbers, strings, lists, tuples and dicts.
        step: the global optimizer step, recorded in the manifest and the file name.
        name: a fixed name (e.g. ``"best"``) instead of ``step-<step>``; never pruned.
        keep_last: after the write, remove all but this many ``step-*`` checkpoints.
        meta: extra manifest fields (config hash, versions, epoch).
    """
    _refuse_shards(state)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(directory)
    path = checkpoint_path(directory, step=step, name=name)
    # The tensors' bytes: no directory scan on the save path
    needed = state_bytes(state)
    room_check(directory, needed=needed, what=f"checkpoint {path.name}")
    # Invalidate any previous checkpoint under this name before its data file is replaced.
    manifest_path(path).unlink(missing_ok=True)
    try:
        digest, size = write_atomically(path, lambda f: torch.save(state, f), durable=True)
        manifest = {
            "format": FORMAT_VERSION,
            "file": path.name,
            "bytes": size,
            "sha256": digest,
            "step": step,
            "created": time.time(),
            **(meta or {}),
        }
        write_atomically(manifest_path(path), json.dumps(manifest, indent=1), durable=True)
    except (OSError, RuntimeError) as exc:
        # torch's zip writer reports a full disk as a RuntimeError
        # A data file without its manifest is no checkpoint: give its space back
        path.unlink(missing_ok=True)
        newest = list_checkpoints(directory)
        raise write_failure(
            f"checkpoint {path.name}", directory, exc, needed=needed, newest=newest[-1].path if newest else None
        ) from None
    if keep_last is not None:
        prune(directory, keep_last)
    return CheckpointInfo(path, manifest)


def _refuse_shards(state: StateTree) -> None:
    """One rank's DTensor shards are not a checkpoint (e.g. a lone survivor's crash save under FSDP2)."""
    values = state.values() if isinstance(state, dict) else state if isinstance(state, (list, tuple)) else ()
    for value in values:
        if hasattr(value, "full_tensor"):
            raise CheckpointError(
                "a single-file checkpoint cannot hold FSDP2's DTensor shards; sharded runs save DCP directories"
            )
        _refuse_shards(value)


def save_atomically(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save(obj, path)`` such that ``path`` is never seen half-written (model.pt, exports)."""
    write_atomically(path, lambda f: torch.save(obj, f), durable=True)


def remove_stale_temporaries(directory: Path) -> None:
    """Delete temporary files left by a write that was killed."""
    for tmp in directory.glob(".*.tmp"):
        tmp.unlink(missing_ok=True)


def prune(directory: Path, keep_last: int) -> None:
    """Remove all but the newest ``keep_last`` valid ``step-*`` checkpoints (manifest first)."""
    for info in list_checkpoints(directory)[:-keep_last]:
        # From here on the data file counts as invalid
        manifest_path(info.path).unlink(missing_ok=True)
        shutil.rmtree(info.path, ignore_errors=True) if info.path.is_dir() else info.path.unlink(missing_ok=True)


def validate_checkpoint(path: str | os.PathLike, *, verify_hash: bool = True) -> CheckpointInfo:
    """Check that ``path`` is a complete checkpoint: manifest present, size and checksum match.

    Raises:
        CheckpointError: saying what is wrong (missing, no manifest, truncated, corrupt).
    """
    path = Path(path)
    if path.suffix == ".dcp":
        return _validate_dcp(path)
    if path.is_dir():
        latest = find_latest_checkpoint(path)
        if latest is None:
            raise CheckpointError(f"checkpoint directory {path} holds no complete checkpoint")
        return latest
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        manifest = json.loads(manifest_path(path).read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint {path} has no manifest {manifest_path(path).name}: the write did not finish"
        ) from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint manifest {manifest_path(path)} is unreadable: {exc}") from None
    if (
        not isinstance(manifest, dict)
        or not {"bytes", "sha256", "step"} <= manifest.keys()
        or type(manifest["step"]) is not int
    ):
        raise CheckpointError(f"checkpoint manifest {manifest_path(path)} is not a ddpkit manifest")
    try:
        size = path.stat().st_size if path.is_file() else None
        if size != manifest["bytes"]:
            raise CheckpointError(
                f"checkpoint {path} is truncated or altered: {size} bytes, manifest says {manifest['bytes']}"
            )
        if verify_hash and file_sha256(path) != manifest["sha256"]:
            raise CheckpointError(f"checkpoint {path} is corrupt: its SHA-256 does not match the manifest")
    except OSError as exc:
        # Unreadable (permissions, a lost mount): not a checkpoint this run can use
        raise CheckpointError(f"checkpoint {path} cannot be read: {exc.strerror or exc}") from None
    return CheckpointInfo(path, manifest)


def _validate_dcp(path: Path) -> CheckpointInfo:
    """A sharded checkpoint directory counts when its manifest exists and lists every file at its size."""
    try:
        manifest = json.loads(manifest_path(path).read_text())
    except (OSError, ValueError):
        raise CheckpointError(
            f"sharded checkpoint {path} has no readable manifest {manifest_path(path).name}: the save did not finish"
        ) from None
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != "dcp"
        or manifest.get("file") != path.name
        or type(manifest.get("step")) is not int
    ):
        raise CheckpointError(
            f"sharded checkpoint {path}: its manifest {manifest_path(path).name} describes another file"
        )
    for name, size in manifest.get("files", {}).items():
        if not (path / name).is_file() or (path / name).stat().st_size != size:
            raise CheckpointError(
                f"sharded checkpoint {path} is incomplete or altered: {name} is missing or not {size} bytes"
            )
    return CheckpointInfo(path, manifest)


def list_checkpoints(directory: str | os.PathLike) -> list[CheckpointInfo]:
    """``step-*`` checkpoints with a readable manifest whose size matches, oldest first (checksums not verified)."""
    found = []
    directory = Path(directory)
    if not directory.is_dir():
        return []
    for path in directory.iterdir():
        if _STEP_FILE.match(path.name):
            try:
                found.append(validate_checkpoint(path, verify_hash=False))
            except CheckpointError:
                continue
    return sorted(found, key=lambda info: info.step)


def find_latest_checkpoint(directory: str | os.PathLike) -> CheckpointInfo | None:
    """The newest checkpoint in ``directory`` that passes full validation.

    Newer files that fail (a truncated or bit-flipped write, a data file whose manifest is
    missing) are reported with a warning and skipped.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return None
    candidates = sorted((p for p in directory.iterdir() if _STEP_FILE.match(p.name)), reverse=True)
    for path in candidates:
        try:
            return validate_checkpoint(path)
        except CheckpointError as exc:
            log.warning("skipping checkpoint: %s", exc)
    return None


def resolve_resume_path(resume: str, directory: str | os.PathLike) -> CheckpointInfo | None:
    """What ``checkpoint.resume`` points at: ``auto`` (newest valid in ``directory``, or None), ``none``, or a path."""
    if resume == "none":
        return None
    if resume == "auto":
        return find_latest_checkpoint(directory)
    try:
        return validate_checkpoint(Path(resume).expanduser())
    except CheckpointError as exc:
        raise CheckpointError(f"checkpoint.resume={resume}: {exc}") from None


def load_checkpoint(path: str | os.PathLike, *, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a state dict with ``weights_only=True``; refuse anything that would execute code."""
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch's message is long and its wording varies by version; keep the refused global's name.
        refused = re.search(r"GLOBAL ([\w.]+)", str(exc))
        detail = f"it references {refused.group(1)}" if refused else type(exc).__name__
        raise CheckpointError(
            f"refusing to load {path}: it contains a pickled object that could run code when loaded "
            f"({detail}). ddpkit loads only tensors and plain values (weights_only=True); "
            "load only checkpoints written by ddpkit or another source you trust."
        ) from None
    except (RuntimeError, OSError, EOFError, ValueError) as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(state).__name__}, not a state dict")
    return state


class AsyncCheckpointWriter:
    """Runs :func:`save_checkpoint` in a background thread, at most one save in flight.

    ``stage_and_submit`` waits for the previous save (so two writes never overlap and its host
    buffers are free), copies the state into reused host buffers (pinned for CUDA tensors: the
    copies are only queued, :mod:`ddpkit.checkpoint.staging`), then starts the write and returns;
    the write waits for the copies to land first. An error in the background is raised by the next
    ``stage_and_submit`` or ``wait``, so it is never lost.
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._staging = HostStaging()

    def stage_and_submit(self, state: dict[str, Any], directory: str | os.PathLike, **kwargs: Any) -> None:
        """Write the state as it is now, in the background; training may change ``state`` as soon as this returns."""
        # Before the copy: the previous save may still be reading these buffers
        self.wait()
        staging = self._staging
        host = self._staging.copy(state)

        def run() -> None:
            try:
                # The copies queued on the GPU have landed
                staging.synchronize()
                save_checkpoint(host, directory, **kwargs)
            except BaseException as exc:
                # Re-raised on the training thread by wait()
                self._error = exc

        self._thread = threading.Thread(target=run, name="ddpkit-checkpoint", daemon=False)
        self._thread.start()

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error = self._error
            self._error = None
            raise error
