"""One copy of in-memory data per host: every local rank and DataLoader worker reads one shared buffer.

    class MyTrainer(ddpkit.Trainer):
        def build_datasets(self):
            train = SharedDataset(lambda: load_records("train.jsonl"), name="train")   # a list of dicts
            val = SharedDataset((images, labels), name="val")                         # arrays or tensors
            return train, val

A plain Python list is copied page by page into every rank and every DataLoader worker (reading
an object writes its reference count: pytorch#13246), so 8 ranks x 4 workers can hold ~40 copies.
Here local rank 0 serialises the data once into one file in ``/dev/shm`` (records: pickled,
one after the other, with an int64 offset table; arrays and tensors: their raw bytes), and
every process maps it read-only: the pages exist once per host. The other ranks learn the
file's path from their host's local rank 0 through one all-gather, after it is written. A callable is called on local
rank 0 only, so the other ranks never build the data at all.

Crash and restart: the file is named by the job's run id and master port, the restart attempt
(``TORCHELASTIC_RESTART_COUNT``) and the pid of the rank that wrote it, written under a temporary
name and renamed when complete, so a new attempt never meets a stale or half-written segment
(the ``FileExistsError`` of mosaicml/streaming #781). The writer removes it at exit, and every
writer first removes segments whose writer is dead (a SIGKILLed job). ``DDPKIT_SHARED_DIR``
(or ``directory=``) puts it elsewhere, e.g. when ``/dev/shm`` is small in a container.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import mmap
import multiprocessing.util as mp_util
import os
import pickle
import socket
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from ddpkit.atomic import write_atomically
from ddpkit.distributed.collectives import all_gather_object
from ddpkit.distributed.env import DistEnv, read_dist_env
from ddpkit.distributed.processes import is_alive
from ddpkit.errors import DataError

__all__ = ["SharedDataset", "shared_dir", "remove_stale_segments"]

_MAGIC = b"DDPKSHM1"
_PREFIX = "ddpkit-shared-"


def shared_dir() -> Path:
    """Where segments live: ``DDPKIT_SHARED_DIR``, else ``/dev/shm`` (memory), else the temp directory."""
    chosen = os.environ.get("DDPKIT_SHARED_DIR")
    if chosen:
        return Path(chosen)
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


class SharedDataset(Dataset):
    """A map-style dataset over one shared, read-only copy of ``data`` per host.

    Args:
        data: a sequence of picklable records; a numpy array or tensor (one sample per row); a
            tuple of them of equal length (samples are tuples of rows); or a callable returning
            one of these, called on local rank 0 only.
        name: tells this job's segments apart (e.g. ``train`` / ``val``).
        env: where this process sits (default: read from the environment).
        directory: where the segment lives (default: :func:`shared_dir`).

    Every rank must construct it (a collective when a process group exists: one all-gather).
    """

    def __init__(
        self, data: Any, *, name: str = "data", env: DistEnv | None = None, directory: str | os.PathLike | None = None
    ):
        env = env or read_dist_env()
        folder = Path(directory) if directory else shared_dir()
        key = _segment_key(env, name)
        self.path: Path | None = None
        if env.local_rank == 0:
            self.path = _write_once(data, folder, key)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # After the writes: every rank learns its host's segment from its local rank 0 (never another job's)
            host = socket.gethostname()
            written = all_gather_object((socket.gethostname(), self.path))
            self.path = next(path for on, path in written if on == host and path is not None)
        elif self.path is None:
            # No process group: local rank 0's file appears, complete, by rename.
            self.path = _find(folder, key)
        self._open()

    def _open(self) -> None:
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        header_at = int.from_bytes(self._map[8:16], "little")
        self.header = pickle.loads(self._map[header_at:])
        self._arrays = [
            np.frombuffer(self._map, dtype=dtype, count=int(np.prod(shape)), offset=at).reshape(shape)
            for dtype, shape, at in self.header["arrays"]
        ]

    def __len__(self) -> int:
        return self.header["length"]

    def __getitem__(self, index: int) -> Any:
        if self.header["kind"] == "records":
            start = self._arrays[0][index]
            stop = self._arrays[0][index + 1]
            return pickle.loads(self._map[start:stop])
        # A copy: the map is read-only.
        rows = [np.array(array[index]) for array in self._arrays]
        rows = [torch.from_numpy(row) if tensor else row for row, tensor in zip(rows, self.header["tensors"])]
        return tuple(rows) if self.header["kind"] == "tuple" else rows[0]

    def __getstate__(self) -> dict[str, Any]:
        # A spawned worker maps the same file again instead of copying it.
        return {"path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path = state["path"]
        self._open()


def _write_once(data: Any, folder: Path, key: str) -> Path:
    """Local rank 0: remove dead writers' segments, write this one, and remove it when this process exits."""
    remove_stale_segments(folder)
    path = _write(data() if callable(data) else data, folder / f"{key}.{os.getpid()}")
    if callable(data):
        # The records it built are garbage now: give their pages back.
        _release_freed_memory()
    # Removed at exit: a torchrun worker exits through atexit, a multiprocessing child through Finalize.
    atexit.register(_remove, path, os.getpid())
    mp_util.Finalize(None, _remove, args=(path, os.getpid()), exitpriority=0)
    return path


def _segment_key(env: DistEnv, name: str) -> str:
    """This job, attempt and dataset: run id (torchrun's rendezvous id or SLURM's job id) and master port."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SLURM_JOB_ID") or "none"
    safe = "".join(
        c if c.isalnum() or c in "-_" else "_" for c in f"{run_id}-{env.master_port}-a{env.restart_count}-{name}"
    )
    return _PREFIX + safe


def _write(data: Any, path: Path) -> Path:
    """Serialise ``data`` into ``path`` (under a temporary name, renamed when complete)."""

    def write(f: Any) -> None:
        f.write(_MAGIC + bytes(8))
        header = _write_arrays(f, data) if _is_arrays(data) else _write_records(f, data)
        header_at = f.tell()
        f.write(pickle.dumps(header))
        f.seek(8)
        f.write(header_at.to_bytes(8, "little"))

    try:
        # Shared memory: no fsync, it does not outlive the host.
        write_atomically(path, write)
    except OSError as error:
        raise DataError(
            f"SharedDataset: cannot write the shared copy to {path.parent} ({error}). Point DDPKIT_SHARED_DIR "
            "(or directory=) at a local directory with room for the data, e.g. DDPKIT_SHARED_DIR=/tmp."
        ) from None
    return path


def _is_arrays(data: Any) -> bool:
    kinds = (np.ndarray, torch.Tensor)
    if isinstance(data, kinds):
        return True
    return isinstance(data, tuple) and bool(data) and all(isinstance(part, kinds) for part in data)


def _write_arrays(f: Any, data: Any) -> dict[str, Any]:
    parts = list(data) if isinstance(data, tuple) else [data]
    if len({len(part) for part in parts}) != 1:
        raise DataError(
            "SharedDataset: the arrays have different lengths "
            f"({[len(p) for p in parts]}); give one row per sample in each"
        )
    arrays = []
    for part in parts:
        array = np.ascontiguousarray(part.numpy() if isinstance(part, torch.Tensor) else part)
        # Aligned, so each dtype can be viewed in place.
        f.write(bytes(-f.tell() % 64))
        arrays.append((array.dtype.str, array.shape, f.tell()))
        f.write(memoryview(array).cast("B"))
    tensors = [isinstance(part, torch.Tensor) for part in parts]
    return {
        "kind": "tuple" if isinstance(data, tuple) else "array",
        "length": len(parts[0]),
        "arrays": arrays,
        "tensors": tensors,
    }


def _write_records(f: Any, records: Sequence[Any]) -> dict[str, Any]:
    if not isinstance(records, Sequence):
        raise DataError(
            "SharedDataset: expected a sequence of records, a numpy array, a "
            f"tensor or a tuple of them, got {type(records).__name__}"
        )
    offsets = np.empty(len(records) + 1, dtype=np.int64)
    for i, record in enumerate(records):
        offsets[i] = f.tell()
        f.write(pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL))
    offsets[-1] = f.tell()
    f.write(bytes(-f.tell() % 64))
    at = f.tell()
    f.write(offsets.tobytes())
    return {
        "kind": "records",
        "length": len(records),
        "arrays": [(offsets.dtype.str, offsets.shape, at)],
        "tensors": [False],
    }


def _find(folder: Path, key: str, timeout: float = 300.0) -> Path:
    """Local rank 0's segment (waited for when there is no process group to wait with)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        # A segment being written is hidden (.NAME.PID.tmp) until renamed.
        found = list(folder.glob(f"{key}.*"))
        if found:
            return max(found, key=lambda p: p.stat().st_mtime)
        time.sleep(0.05)
    raise DataError(
        f"SharedDataset: local rank 0 wrote no {folder}/{key}.<pid> within "
        f"{timeout:.0f} s; did it fail, or construct the dataset?",
        retryable=True,
    )


def remove_stale_segments(folder: Path) -> list[Path]:
    """Remove segments (and half-written ones) whose writer process is gone; return what was removed."""
    removed = []
    for path in [*folder.glob(_PREFIX + "*"), *folder.glob(f".{_PREFIX}*.tmp")]:
        pid = path.name.removesuffix(".tmp").rsplit(".", 1)[-1]
        if pid.isdigit() and not is_alive(int(pid)):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _release_freed_memory() -> None:
    """Collect garbage and hand glibc's freed heap pages back to the OS (malloc keeps them otherwise)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        # Not glibc: the pages are reused by later allocations instead.
        pass


def _remove(path: Path, owner: int) -> None:
    # Never from a forked child that inherited the handler.
    if os.getpid() == owner:
        path.unlink(missing_ok=True)
