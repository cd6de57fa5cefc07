"""Room for a checkpoint: a warning before a save that will not fit, one line when a save failed.

    room_check(directory, needed=state_bytes(state), what="checkpoint step-000000030.pt")   # logs a warning
    raise write_failure("checkpoint step-000000030.pt", directory, exc, needed=..., newest=newest_path)

A failed checkpoint write (a full disk, a quota, a lost mount) ends the run with one
:class:`~ddpkit.errors.CheckpointError` line naming the checkpoint, the directory, the space it
needed and the space free (``shutil.disk_usage``), and the newest complete checkpoint, which the
same command resumes from once the cause is fixed. The writers (:mod:`ddpkit.checkpoint.files`,
:mod:`ddpkit.checkpoint.sharded`) remove what the failed write left before raising it.

``torch.save`` on a full disk does not always raise ``OSError``: its zip writer may fail first with
a ``RuntimeError`` ("unexpected pos ..."). So a failure counts as a lack of space when its errno
says so (``ENOSPC``, ``EDQUOT``) or when less is free than the checkpoint needs.
"""

from __future__ import annotations

import errno
import logging
import shutil
from pathlib import Path

import torch

from ddpkit.checkpoint.components import StateTree
from ddpkit.errors import CheckpointError, first_line

__all__ = ["state_bytes", "free_bytes", "short_of_room", "room_check", "write_failure", "human_bytes"]

log = logging.getLogger("ddpkit")

_NO_SPACE = {errno.ENOSPC, errno.EDQUOT}
#: torch.save's zip framing and pickled structure on top of the tensors' bytes
_SLACK = 1.05
_warned: set[str] = set()


def state_bytes(state: StateTree) -> int:
    """The bytes of every tensor in ``state`` (nested dicts, lists, tuples): what a save writes, give or take its
    framing."""
    if isinstance(state, torch.Tensor):
        # A DTensor: this rank's shard
        local = state.to_local() if hasattr(state, "to_local") else state
        return local.untyped_storage().nbytes() if local.device.type != "meta" else 0
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0


def free_bytes(directory: Path) -> int | None:
    """Bytes free to this user in ``directory``'s filesystem, or None where that cannot be asked."""
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def short_of_room(directory: Path, *, needed: int) -> int | None:
    """The free bytes in ``directory`` when a save of ``needed`` bytes (plus its framing) cannot fit there, else
    None."""
    free = free_bytes(directory)
    return free if free is not None and free < needed * _SLACK else None


def room_check(directory: Path, *, needed: int, what: str) -> None:
    """Warn (once per directory and run) when ``directory`` has less room than ``needed`` bytes: the save will
    likely fail."""
    free = short_of_room(directory, needed=needed)
    if free is None or str(directory) in _warned:
        return
    _warned.add(str(directory))
    log.warning(
        "ddpkit: %s needs about %s, but only %s is free in %s: free space now, or the save will fail "
        "(the run then stops with the newest complete checkpoint kept)",
        what,
        human_bytes(needed),
        human_bytes(free),
        directory,
    )


def write_failure(
    what: str, directory: Path, exc: BaseException, *, needed: int, newest: Path | None
) -> CheckpointError:
    """The one-line error for a failed checkpoint write (raise it ``from None``)."""
    free = free_bytes(directory)
    no_space = (
        getattr(exc, "errno", None) in _NO_SPACE
        or (free is not None and free < needed)
        # DCP wraps each rank's error
        or any(text in str(exc) for text in ("No space left on device", "Disk quota exceeded"))
    )
    reason = "no space left on device" if no_space else first_line(exc)
    room = f"it needs about {human_bytes(needed)}, {human_bytes(free) if free is not None else 'unknown space'} free"
    kept = (
        f"the newest complete checkpoint is {newest.name} (valid, kept); "
        if newest is not None
        else "there is no earlier complete checkpoint; "
    )
    fix = "free space" if no_space else "fix the cause"
    return CheckpointError(
        f"could not write {what} in {directory}: {reason} ({room}); {kept}{fix} and run the same command to "
        f"{'resume' if newest is not None else 'start again'}"
    )


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            break
    return f"{n:.1f} {unit}"
