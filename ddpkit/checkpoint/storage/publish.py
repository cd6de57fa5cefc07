"""Publish one local checkpoint to the store: data objects first, the manifest last, then retention.

    publish_checkpoint(store, job, epoch=3, keep_last=2, protected={"step-000000100.pt"})

Runs in the upload process (:mod:`ddpkit.checkpoint.storage.worker`), never on the training thread.
A sharded checkpoint spread over nodes without a shared disk is published in parts: each node's
upload process sends the shard files its ranks wrote and a part list (``.ddpkit/parts/<name>/node-<k>.json``);
node 0's waits for every part, then writes the one manifest covering them all. The run's files go up whole
(:func:`publish_file`: ``metrics.jsonl``, ``model.pt``), and its ``hf/`` directory with its ``config.json`` last
(:func:`publish_directory`).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from ddpkit.checkpoint.storage.layout import FORMAT, manifest_name, newest_fence, retire
from ddpkit.checkpoint.storage.store import Store
from ddpkit.errors import CheckpointError

__all__ = [
    "publish_checkpoint",
    "publish_file",
    "publish_directory",
    "newer_committed",
    "NotRetried",
    "LeaseLost",
    "LocalSaveFailed",
    "Superseded",
    "PART_WAIT_S",
    "COMMIT_WAIT_S",
]

#: Seconds node 0's upload waits for the other nodes' shards of a sharded checkpoint.
PART_WAIT_S = 600.0
#: Seconds an upload waits for its local save to be committed (a ``checkpoint.async`` write still in progress).
COMMIT_WAIT_S = 900.0
_SHARD = re.compile(r"^__(\d+)_\d+\.distcp$")
_STEP_MANIFEST = re.compile(r"^step-\d{9}\.json$")


class NotRetried(CheckpointError):
    """An upload that a retry cannot help: given up at once."""


class LeaseLost(NotRetried):
    """A newer run took the store's lock: this run's checkpoints can no longer count."""


class LocalSaveFailed(NotRetried):
    """The local save this upload waited for never completed."""


class Superseded(NotRetried):
    """The local checkpoint is gone because a newer one replaced it (pruned): nothing lost, nothing to send."""


def publish_checkpoint(
    store: Store, job: dict[str, Any], *, epoch: int | None, keep_last: int | None, protected: set[str]
) -> dict[str, Any]:
    """Upload the checkpoint ``job["path"]`` names; returns ``{"name", "step", "bytes"}`` of what was sent.

    Raises :class:`NotRetried` when the local save never completed or another run holds the lock now,
    FileNotFoundError when the local checkpoint is gone, and the store's own errors otherwise.
    """
    path = Path(job["path"])
    name = path.name
    node = job.get("node", 0)
    nodes = job.get("nodes", 1)
    if node == 0:
        _wait_committed(path, job["step"])
    create = name.startswith("step-")
    if node == 0 and store.get_bytes(manifest_name(name)) is not None:
        if name in protected:
            # The one this run resumed from: there already
            return {"name": name, "step": job["step"], "bytes": 0}
        # An older save under this name stops counting before its data changes
        store.delete([manifest_name(name)])
    objects = _send(store, path, node=node, nodes=nodes, ranks=job.get("ranks", ()))
    if node != 0:
        store.put_bytes(f".ddpkit/parts/{name}/node-{node:05d}.json", json.dumps(objects).encode())
        return {"name": name, "step": job["step"], "bytes": sum(o["bytes"] for o in objects.values())}
    if nodes > 1:
        objects.update(_wait_for_parts(store, name, nodes))
    _commit(store, path, objects, step=job["step"], epoch=epoch, create=create)
    if nodes > 1:
        store.delete([f".ddpkit/parts/{name}/node-{k:05d}.json" for k in range(1, nodes)])
    if create and keep_last is not None:
        retire(store, keep_last=keep_last, protected=protected, epoch=epoch)
    return {"name": name, "step": job["step"], "bytes": sum(o["bytes"] for o in objects.values())}


def _commit(store: Store, path: Path, objects: dict[str, Any], *, step: int, epoch: int | None, create: bool) -> None:
    """The manifest, last: every object with its size and sha256, the epoch, and the local manifest to restore."""
    local = json.loads(_local_manifest(path).read_text())
    if path.suffix == ".dcp":
        local["files"] = {key.split("/", 1)[1]: spec["bytes"] for key, spec in objects.items()}
    _check_lease(store, epoch)
    manifest = {
        "format": FORMAT,
        "name": path.name,
        "step": step,
        "epoch": epoch,
        "created": time.time(),
        "objects": objects,
        "local": local,
    }
    store.put_bytes(manifest_name(path.name), json.dumps(manifest, indent=1).encode(), create=create)


def publish_file(store: Store, job: dict[str, Any]) -> dict[str, Any]:
    """Upload a run file (``metrics.jsonl``, ``model.pt``) over its previous copy; a JSONL file up to its last
    complete line (the trainer may be appending to it right now)."""
    path = Path(job["path"])
    if job.get("lines"):
        data = path.read_bytes()
        data = data[: data.rfind(b"\n") + 1]
        store.put_bytes(job["name"], data)
        return {"name": job["name"], "bytes": len(data)}
    _, size = store.put_file(path, job["name"])
    return {"name": job["name"], "bytes": size}


def publish_directory(store: Store, job: dict[str, Any]) -> dict[str, Any]:
    """Upload the local directory ``job["path"]`` (the run's ``hf/``) as ``job["name"]/...`` over its previous copy,
    so that a reader finds it complete or finds it incomplete, never a mix that looks complete.

    An object store has no rename: objects appear one by one. So ``job["last"]``'s files (``hf/``'s index, then its
    ``config.json``, without which transformers loads nothing) play a manifest's part: they are deleted first, the
    previous copy's marker before anything of it changes; then the objects the new copy lacks go, every other file is
    sent, and the ``last`` files are sent in their order after all of them. An upload cut short leaves no marker.
    """
    local = Path(job["path"])
    name = job["name"]
    last = list(job.get("last", ()))
    files = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
    missing = [marker for marker in last if marker not in files]
    if missing:
        raise NotRetried(f"{local} has no {', '.join(missing)}: it is incomplete and not uploaded")
    store.delete([f"{name}/{marker}" for marker in reversed(last)])
    # A previous copy's files this one lacks (another file count: model-00003-of-00004.safetensors)
    previous = [key for key in store.listing(f"{name}/") if key.startswith(f"{name}/")]
    store.delete([key for key in previous if key[len(name) + 1 :] not in files])
    sent = 0
    for file in [f for f in files if f not in last] + last:
        sent += store.put_file(local / file, f"{name}/{file}")[1]
    return {"name": name, "bytes": sent}


def _local_manifest(path: Path) -> Path:
    return path.with_suffix(".json")


def _wait_committed(path: Path, step: int) -> None:
    """Wait until ``path``'s local manifest says it holds ``step``: the save is committed (an async one may be
    queued before its background write finished)."""
    deadline = time.monotonic() + COMMIT_WAIT_S
    while True:
        try:
            manifest = json.loads(_local_manifest(path).read_text())
            if manifest.get("step") == step and manifest.get("file") == path.name:
                return
        except (OSError, ValueError):
            # Not written yet, or being written
            pass
        if time.monotonic() > deadline:
            raise LocalSaveFailed(f"{path}: the local save of step {step} did not complete in {COMMIT_WAIT_S:.0f} s")
        # Pruned after a newer save, or its write failed and a later one did not
        if newer_committed(path, step):
            raise Superseded(f"{path}: no longer on this disk (a newer checkpoint replaced it); not uploaded")
        time.sleep(0.2)


def newer_committed(path: Path, step: int) -> bool:
    """Whether a ``step-*`` checkpoint newer than ``step`` is committed beside ``path`` (so ``path`` may be pruned)."""
    if not path.name.startswith("step-"):
        return False
    try:
        names = [f.name for f in path.parent.iterdir()]
    except OSError:
        # The folder itself is gone
        return True
    return any(_STEP_MANIFEST.match(name) and int(name[5:14]) > step for name in names)


def _send(store: Store, path: Path, *, node: int, nodes: int, ranks: Any) -> dict[str, dict[str, Any]]:
    """Upload the data objects of ``path`` this node holds: ``{key: {"bytes", "sha256"}}``."""
    if path.suffix != ".dcp":
        sha, size = store.put_file(path, path.name)
        return {path.name: {"bytes": size, "sha256": sha}}
    # A node whose rank 0 is elsewhere
    folder = path if path.is_dir() else path.with_name(f".{path.name}.partial")
    if not folder.is_dir():
        raise FileNotFoundError(f"{path}: no such sharded checkpoint on this node")
    mine = {int(r) for r in ranks}
    objects = {}
    for file in sorted(folder.iterdir()):
        shard = _SHARD.match(file.name)
        if file.is_file() and (nodes == 1 or (shard and int(shard.group(1)) in mine) or (node == 0 and not shard)):
            sha, size = store.put_file(file, f"{path.name}/{file.name}")
            objects[f"{path.name}/{file.name}"] = {"bytes": size, "sha256": sha}
    return objects


def _wait_for_parts(store: Store, name: str, nodes: int) -> dict[str, dict[str, Any]]:
    """The other nodes' part lists, merged; waits up to PART_WAIT_S for the last one."""
    deadline = time.monotonic() + PART_WAIT_S
    wanted = [f".ddpkit/parts/{name}/node-{k:05d}.json" for k in range(1, nodes)]
    while True:
        parts = [store.get_bytes(key) for key in wanted]
        if all(part is not None for part in parts):
            merged: dict[str, dict[str, Any]] = {}
            for part in parts:
                merged.update(json.loads(part))
            return merged
        if time.monotonic() > deadline:
            missing = sum(part is None for part in parts)
            raise CheckpointError(
                f"{name}: {missing} of {nodes - 1} other nodes did not upload their shards in {PART_WAIT_S:.0f} s"
            )
        time.sleep(2.0)


def _check_lease(store: Store, epoch: int | None) -> None:
    if epoch is None:
        return
    fence = newest_fence(store)
    if fence is not None and fence.get("epoch") != epoch:
        raise LeaseLost(
            f"{store.url} was taken over by another run (lock epoch {fence.get('epoch')}, this run's {epoch}): "
            "this run's checkpoints are no longer published there"
        )
