"""What a checkpoint is on an object store, how the newest valid one is found, fetched and retired.

Under ``checkpoint.dir`` (a URL), beside the local names of :mod:`ddpkit.checkpoint.files`::

    step-000001200.pt                 data objects: written once, never changed in place
    step-000001200.dcp/__0_0.distcp   (a sharded checkpoint: one object per file of the .dcp folder)
    step-000001200.json               the manifest, written last and create-only: every data object with
                                      its size and sha256, the step, the lease epoch, the local manifest
    .ddpkit/epoch-000000003.json      one fence per run start that took the lock (storage/lease.py)
    .ddpkit/lock.json                 the run lock, renewed as a lease
    metrics.jsonl, model.pt           the run's records and final weights, overwritten as they grow

A checkpoint counts when its manifest exists, names this layout, belongs to the current lease epoch
or was already counting when that epoch began, and every object it lists is in the listing at its
size. The sha256 is checked when the objects are downloaded. Finding the newest one costs one
listing and the manifests read newest first; no object is ever renamed (stores cannot).
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpkit.checkpoint.storage.store import Store
from ddpkit.errors import CheckpointError

__all__ = [
    "RemoteCheckpoint",
    "FORMAT",
    "FENCE_PREFIX",
    "newest_fence",
    "counting",
    "find_remote",
    "download",
    "retire",
]

log = logging.getLogger("ddpkit")

FORMAT = "ddpkit-remote-1"
FENCE_PREFIX = ".ddpkit/epoch-"
_MANIFEST = re.compile(r"^step-\d{9}\.json$")
#: Any object of a step: data or manifest
_ANY = re.compile(r"^step-(\d{9})[./]")
_FENCE = re.compile(r"^\.ddpkit/epoch-(\d{9})\.json$")


@dataclass(frozen=True)
class RemoteCheckpoint:
    """A committed remote checkpoint: its local name (``step-000001200.pt``) and its manifest."""

    name: str
    manifest: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.manifest["step"])


def manifest_name(name: str) -> str:
    """``step-000001200.pt`` -> ``step-000001200.json`` (the local rule of files.manifest_path)."""
    return f"{name.rsplit('.', 1)[0]}.json"


def newest_fence(store: Store, listing: dict[str, int] | None = None) -> dict[str, Any] | None:
    """The fence of the newest lease epoch (``{"epoch": 3, "accepted": [...]}``), or None on a store never locked."""
    listing = store.listing(".ddpkit") if listing is None else listing
    epochs = sorted(int(m.group(1)) for name in listing if (m := _FENCE.match(name)))
    for epoch in reversed(epochs):
        data = store.get_bytes(f"{FENCE_PREFIX}{epoch:09d}.json")
        if data is not None:
            try:
                return json.loads(data)
            except ValueError:
                # A fence being written right now by a racing run: the older one still rules
                continue
    return None


def counting(manifest: dict[str, Any], fence: dict[str, Any] | None) -> bool:
    """Whether a manifest counts under the newest fence: written in that epoch, or accepted when it began.

    A run that lost its lease (a frozen VM that wakes up) still holds an older epoch: what it
    publishes after the takeover is in neither, so it never becomes "the newest checkpoint".
    """
    if fence is None:
        return True
    return manifest.get("epoch") == fence.get("epoch") or manifest.get("name") in fence.get("accepted", ())


def _manifests(store: Store, listing: dict[str, int], fence: dict[str, Any] | None) -> list[RemoteCheckpoint]:
    """Complete, counting checkpoints, newest first (manifests read one by one, stopping at none)."""
    found = []
    for key in sorted((key for key in listing if _MANIFEST.match(key)), reverse=True):
        data = store.get_bytes(key)
        try:
            manifest = json.loads(data) if data is not None else None
        except ValueError:
            manifest = None
        if (
            not isinstance(manifest, dict)
            or manifest.get("format") != FORMAT
            or manifest_name(str(manifest.get("name"))) != key
        ):
            continue
        name = manifest["name"]
        if not counting(manifest, fence):
            log.warning(
                "ddpkit: ignoring remote checkpoint %s/%s: written by a run that had lost the lock (epoch %s)",
                store.url,
                name,
                manifest.get("epoch"),
            )
            continue
        objects = manifest.get("objects", {})
        if objects and all(listing.get(key) == spec.get("bytes") for key, spec in objects.items()):
            found.append(RemoteCheckpoint(name, manifest))
    return found


def find_remote(store: Store) -> list[RemoteCheckpoint]:
    """Every valid checkpoint under the store's URL, newest first: one listing, then the manifests."""
    listing = store.listing()
    return _manifests(store, listing, newest_fence(store, listing))


def download(store: Store, checkpoint: RemoteCheckpoint, directory: Path) -> Path:
    """Fetch ``checkpoint`` into ``directory`` so :func:`~ddpkit.checkpoint.files.find_latest_checkpoint` finds it.

    Every object goes to a hidden temporary name, is checked against the manifest's sha256 and size,
    then renamed into place; the local manifest is written last. A mismatch raises
    :class:`CheckpointError` and leaves nothing that local discovery would take for a checkpoint.
    """
    from ddpkit.atomic import write_atomically

    directory.mkdir(parents=True, exist_ok=True)
    staging = directory / f".{checkpoint.name}.fetch"
    staging.mkdir(exist_ok=True)
    for key, spec in checkpoint.manifest["objects"].items():
        local = staging / key
        local.parent.mkdir(parents=True, exist_ok=True)
        sha, size = store.get_file(key, local)
        if sha != spec["sha256"] or size != spec["bytes"]:
            _remove(staging)
            raise CheckpointError(
                f"remote checkpoint {store.url}/{key} is corrupt or altered: its sha256 or size "
                f"({size} bytes) does not match its manifest ({spec['bytes']} bytes); it is not used"
            )
    final = directory / checkpoint.name
    _remove(final)
    os.replace(staging / checkpoint.name, final)
    _remove(staging)
    write_atomically(
        directory / manifest_name(checkpoint.name), json.dumps(checkpoint.manifest["local"], indent=1), durable=True
    )
    return final


def retire(store: Store, *, keep_last: int, protected: set[str], epoch: int | None) -> list[str]:
    """Delete all but the newest ``keep_last`` counting checkpoints (and ``protected``): manifest first, then data.

    Called right after a manifest was committed, so an older checkpoint goes only once a newer one
    counts. Data objects of uploads that never got their manifest (a killed upload) older than the
    newest checkpoint go too. Nothing is deleted by a run that no longer holds the newest epoch.
    """
    listing = store.listing()
    fence = newest_fence(store, listing)
    if epoch is not None and fence is not None and fence.get("epoch") != epoch:
        return []
    valid = _manifests(store, listing, fence)
    if not valid:
        return []
    # A checkpoint's first 14 characters name its step: "step-000001200"
    keep = {c.name[:14] for c in valid[:keep_last]} | {name[:14] for name in protected}
    newest = valid[0].step
    stale = [key for key in listing if (m := _ANY.match(key)) and int(m.group(1)) < newest and key[:14] not in keep]
    manifests = [key for key in stale if key.endswith(".json") and "/" not in key]
    # First: from here on they no longer count
    store.delete(manifests)
    store.delete([key for key in stale if key not in manifests])
    return sorted({key[:14] for key in manifests})


def _remove(path: Path) -> None:
    import shutil

    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()
