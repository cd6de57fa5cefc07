"""Write a file so that no reader ever sees it half-written: the one helper every file writer uses.

    from ddpkit.atomic import write_atomically
    write_atomically(path, b"...")                                  # bytes or str
    write_atomically(path, lambda f: torch.save(state, f))          # or a function that writes to a file
    sha256, size = write_atomically(path, data, durable=True)       # fsync the data and the directory entry
    file_sha256(path)                                               # the same digest, read back a piece at a time

The data goes to a hidden temporary file beside ``path`` (``.NAME.PID.tmp``, the pattern
:func:`ddpkit.checkpoint.files.remove_stale_temporaries` cleans up after a killed writer), is
flushed, and is renamed over ``path`` with ``os.replace``, which is atomic on POSIX filesystems.
If writing fails (a full disk, a closed pipe, an exception in ``write``) the temporary file is
removed and the error propagates: ``path`` keeps its previous content, and nothing is left
behind. ``durable=True`` also fsyncs the file and its directory, so the rename survives a power
loss (checkpoints, manifests); metrics and caches skip that cost.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

__all__ = ["write_atomically", "fsync_dir", "temporary_path", "file_sha256"]

#: Bytes of a file read at a time by :func:`file_sha256`.
_HASH_PIECE = 16 * 1024 * 1024


def temporary_path(path: Path) -> Path:
    """Where ``path`` is written before its rename: hidden, in the same directory, unique per process."""
    return path.parent / f".{path.name}.{os.getpid()}.tmp"


def write_atomically(
    path: str | os.PathLike, data: bytes | str | Callable[[BinaryIO], Any], *, durable: bool = False
) -> tuple[str, int]:
    """Replace ``path`` with ``data`` (bytes, text, or a function writing to a binary file) atomically.

    Returns the SHA-256 and size of what was written. The parent directory must exist."""
    path = Path(path)
    write = data if callable(data) else (lambda f: f.write(data.encode() if isinstance(data, str) else data))
    tmp = temporary_path(path)
    try:
        with open(tmp, "wb") as f:
            writer = _HashingWriter(f)
            write(writer)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        # A failed write leaves nothing behind, whatever failed.
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)
    return writer.sha.hexdigest(), writer.size


def fsync_dir(directory: Path) -> None:
    """Make a rename durable: fsync the directory entry (a no-op where unsupported)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _HashingWriter:
    """A file wrapper that hashes and counts what is written through it (one pass over the data)."""

    def __init__(self, f: BinaryIO):
        self.f = f
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()

    def __getattr__(self, name: str) -> Any:
        """``tell``, ``seek`` and the rest from the file (after a seek the hash no longer matches the file)."""
        return getattr(self.f, name)


def file_sha256(path: str | os.PathLike) -> str:
    """The sha256 (hex) of the file at ``path``, read a piece at a time: what :func:`write_atomically` returns for it,
    without the file in memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while piece := handle.read(_HASH_PIECE):
            digest.update(piece)
    return digest.hexdigest()
