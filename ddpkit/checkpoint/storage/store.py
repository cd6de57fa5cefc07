"""One object-store prefix through fsspec: whole objects in and out, one listing, create-only writes.

    store = open_store("s3://bucket/run", {"profile": "train"})    # ConfigError when s3fs is missing
    store.put_file("/local/step-000000100.pt", "step-000000100.pt")  # (sha256, bytes), hashed while read
    store.put_bytes("step-000000100.json", data, create=True)       # FileExistsError if it exists
    store.listing()                                                 # {"step-000000100.pt": 1234, ...}: one LIST

Credentials come from each cloud's own environment and files (S3: ``AWS_ACCESS_KEY_ID``/``AWS_PROFILE``/
an instance role, ``AWS_ENDPOINT_URL`` for S3-compatible stores; GCS: ``GOOGLE_APPLICATION_CREDENTIALS``;
Azure: ``AZURE_STORAGE_CONNECTION_STRING`` / ``AZURE_STORAGE_ACCOUNT_NAME``), ``checkpoint.storage_options``
adding to them. :meth:`Store.rebuild` makes a new client, which reads them afresh: how an upload
recovers from credentials that expired after an hour. Listings are never cached (a stale listing
would hide a new checkpoint).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path
from typing import Any

from ddpkit.config.urls import STORAGE_SCHEMES, url_scheme
from ddpkit.errors import ConfigError

__all__ = ["Store", "open_store", "CHUNK"]

#: Bytes read, hashed and written at a time when a file is uploaded or downloaded.
CHUNK = 8 << 20
_BACKENDS = {"s3": "s3fs", "gcs": "gcsfs", "azure": "adlfs"}
_PROTOCOL = {"gs": "gcs", "az": "abfs", "abfss": "abfs"}
_EXISTS = ("ResourceExistsError", "PreconditionFailed", "PreconditionFailedError")
# Bounded waits for S3: botocore's defaults (60 s connect, legacy retries) would hold the start-up probe for
# minutes on an unreachable endpoint. Our own retries (storage/worker.py) come on top.
_S3_DEFAULTS = {
    "config_kwargs": {"connect_timeout": 10, "read_timeout": 60, "retries": {"max_attempts": 3, "mode": "standard"}}
}


def _filesystem(scheme: str, options: dict[str, Any], url: str) -> Any:
    extra = STORAGE_SCHEMES.get(scheme)
    if importlib.util.find_spec("fsspec") is None or (extra and importlib.util.find_spec(_BACKENDS[extra]) is None):
        package = _BACKENDS[extra] if extra else "fsspec"
        raise ConfigError(
            f"checkpoint.dir={url} needs {package}, which is not installed: pip install 'ddpkit[{extra or 's3'}]'"
        )
    import fsspec

    options = {**_S3_DEFAULTS, **options} if scheme == "s3" else dict(options)
    if scheme in ("s3", "gs", "gcs", "az", "abfs", "abfss"):
        options.setdefault("use_listings_cache", False)
    return fsspec.filesystem(_PROTOCOL.get(scheme, scheme), skip_instance_cache=True, **options)


class Store:
    """The objects under one URL; names are relative to it (``step-000000100.pt``, ``.ddpkit/lock.json``)."""

    def __init__(self, url: str, options: dict[str, Any] | None = None, *, fs: Any = None):
        self.url = url.rstrip("/")
        self.options = dict(options or {})
        self.scheme = url_scheme(url) or "file"
        self.fs = fs if fs is not None else _filesystem(self.scheme, self.options, self.url)
        self.root = self.fs._strip_protocol(self.url).rstrip("/")
        #: Whether a create-only write is atomic on this store (checked again by the start-up probe).
        self.conditional = self.scheme in ("s3", "gs", "gcs", "az", "abfs", "abfss", "file", "memory")

    def rebuild(self) -> None:
        """A new client: credentials and connections are read again (after an expired token, a dropped connection)."""
        self.fs = _filesystem(self.scheme, self.options, self.url)

    def key(self, name: str) -> str:
        return f"{self.root}/{name}" if name else self.root

    def put_file(self, local: str | os.PathLike, name: str) -> tuple[str, int]:
        """Upload ``local`` as ``name``, streaming; returns the SHA-256 and size of exactly the bytes sent."""
        sha = hashlib.sha256()
        size = 0
        self._parents(name)
        with open(local, "rb") as src, self.fs.open(self.key(name), "wb") as dst:
            while chunk := src.read(CHUNK):
                sha.update(chunk)
                dst.write(chunk)
                size += len(chunk)
        return sha.hexdigest(), size

    def put_bytes(self, name: str, data: bytes, *, create: bool = False) -> None:
        """Write one small object; ``create``: only if absent (``FileExistsError`` otherwise)."""
        self._parents(name)
        if not create:
            self.fs.pipe_file(self.key(name), data)
        elif self.scheme == "file":
            # O_EXCL: atomic on a local or NFS filesystem, where fsspec only checks first
            fd = os.open(self.key(name), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        else:
            # s3fs sends If-None-Match: *; adlfs's overwrite=False the same; for others the start-up probe tells.
            kwargs = {"overwrite": False} if self.scheme in ("az", "abfs", "abfss") else {"mode": "create"}
            try:
                self.fs.pipe_file(self.key(name), data, **kwargs)
            except FileExistsError:
                raise
            except Exception as exc:
                # Each SDK says "exists" its own way: Azure's ResourceExistsError, HTTP 412
                if type(exc).__name__ in _EXISTS or "412" in str(exc) or "PreconditionFailed" in str(exc):
                    raise FileExistsError(f"{self.url}/{name} exists") from exc
                raise

    def get_bytes(self, name: str) -> bytes | None:
        """The object's content, or None when it does not exist."""
        try:
            return self.fs.cat_file(self.key(name))
        except FileNotFoundError:
            return None

    def get_file(self, name: str, local: Path) -> tuple[str, int]:
        """Download ``name`` to ``local``; returns the SHA-256 and size of what arrived."""
        sha = hashlib.sha256()
        size = 0
        with self.fs.open(self.key(name), "rb") as src, open(local, "wb") as dst:
            while chunk := src.read(CHUNK):
                sha.update(chunk)
                dst.write(chunk)
                size += len(chunk)
            dst.flush()
            os.fsync(dst.fileno())
        return sha.hexdigest(), size

    def listing(self, prefix: str = "") -> dict[str, int]:
        """Every object under ``prefix`` (recursively) with its size: one LIST, never from a cache."""
        self.fs.invalidate_cache()
        try:
            found = self.fs.find(self.key(prefix), detail=True)
        except FileNotFoundError:
            return {}
        cut = len(self.root) + 1
        return {
            path[cut:]: int(info.get("size") or 0) for path, info in found.items() if info.get("type") != "directory"
        }

    def delete(self, names: list[str]) -> None:
        """Remove these objects; one already gone is no error."""
        for name in names:
            try:
                self.fs.rm_file(self.key(name))
            except FileNotFoundError:
                pass

    def _parents(self, name: str) -> None:
        # Object stores have no folders; a local one needs them
        if self.scheme == "file":
            Path(self.key(name)).parent.mkdir(parents=True, exist_ok=True)


def open_store(url: str, options: dict[str, Any] | None = None) -> Store:
    """The :class:`Store` for ``url`` (``s3://``, ``gs://``, ``az://``/``abfs://``, ``file://``, ``memory://``)."""
    return Store(url, options)
