"""A disk cache for generated datasets: built once per machine, read back in a fraction of a second.

    images, labels = cached_tensors("digits-v1-24000-28-0.2-1234", lambda: make_digits(24000, seed=1234))

Rendering the embedded ``digits`` data (24,000 images for the quickstart) takes about 4 s of CPU
on every rank at every start, and a restart after a fault paid it again; the same tensors are read
back memory-mapped (``torch.load(mmap=True)``): a few milliseconds, the pages shared with the page
cache and with every rank of the host. Any generated tensors can use it: ``cached_tensors(KEY, build)``
in a Trainer's ``build_datasets`` (``tests/scripts/sklearn_trainer.py`` caches ``make_classification``).
The cache lives in ``$DDPKIT_CACHE_DIR`` (default ``$XDG_CACHE_HOME/ddpkit``, i.e. ``~/.cache/ddpkit``);
set ``DDPKIT_CACHE_DIR=off`` to always build. Files are written to a temporary name and renamed into
place (two ranks building at once both write whole files; the last rename wins), read with
``weights_only=True``, and a file that fails to load is rebuilt. The key must name everything the
result depends on, a version included.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

from ddpkit.atomic import write_atomically

__all__ = ["cache_dir", "cached_tensors"]

logger = logging.getLogger(__name__)


def cache_dir() -> Path | None:
    """Where generated data is cached, or None when caching is off (``DDPKIT_CACHE_DIR=off``)."""
    chosen = os.environ.get("DDPKIT_CACHE_DIR")
    if chosen is not None:
        return None if chosen.strip().lower() in ("", "off", "0", "none") else Path(chosen)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ddpkit"


def cached_tensors(key: str, build: Callable[[], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """``build()``'s tensors, from ``<cache_dir>/<key>.pt`` when a good copy is there (else built and stored)."""
    directory = cache_dir()
    path = directory / f"{key}.pt" if directory is not None else None
    if path is not None and path.is_file():
        try:
            # mmap: the tensors are the page cache's pages, copied only where written (a private mapping), so a
            # restart reads back a dataset the previous attempt cached in milliseconds, whatever its size.
            return tuple(torch.load(path, weights_only=True, mmap=True))
        except Exception as exc:
            # A truncated or foreign file: rebuild it.
            logger.debug("rebuilding %s: %s", path, exc)
    tensors = build()
    if path is not None:
        _store(path, tensors)
    return tensors


def _store(path: Path, tensors: tuple[torch.Tensor, ...]) -> None:
    """Write atomically; a cache that cannot be written (read-only home, full disk) is skipped."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, lambda f: torch.save(list(tensors), f))
    except OSError as exc:
        logger.debug("not caching %s: %s", path, exc)
