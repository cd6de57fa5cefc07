"""Collectives that are safe at any world size: each one acts on this process alone without a group.

    total = all_reduce_sum(torch.tensor([loss_sum, count]))   # the sum over ranks, in place
    most = all_reduce_max(torch.tensor([batches, -batches]))  # the largest and (negated) the smallest
    seeds = all_gather_object(seed)                          # every rank's value, in rank order
    step = broadcast_object(step, src=0)                     # rank 0's value on every rank
    barrier(debug=True)                                      # on Gloo, a stuck rank is named

Without a process group, or in a world of one, they return at once (``[obj]``, ``obj``, the
tensor unchanged), so a code path written for N ranks runs unchanged in a plain ``python train.py``.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["barrier", "all_reduce_sum", "all_reduce_max", "all_gather_object", "broadcast_object"]


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def barrier(*, debug: bool = False, timeout: float | None = None, group: Any = None) -> None:
    """Wait for every rank of ``group`` (None: every rank). With ``debug`` on Gloo, a stuck rank is named."""
    if not _active():
        return
    if debug and dist.get_backend() == "gloo":
        kwargs = {"timeout": datetime.timedelta(seconds=timeout)} if timeout else {}
        dist.monitored_barrier(group=group, wait_all_ranks=True, **kwargs)
    else:
        dist.barrier(group=group)


def all_reduce_sum(tensor: torch.Tensor, *, group: Any = None) -> torch.Tensor:
    """Sum ``tensor`` over the ranks of ``group`` (None: every rank) in place and return it."""
    if _active():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_reduce_max(tensor: torch.Tensor, *, group: Any = None) -> torch.Tensor:
    """The elementwise largest value of ``tensor`` over the ranks of ``group`` (None: every rank), in place."""
    if _active():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


def all_gather_object(obj: Any, *, group: Any = None) -> list[Any]:
    """Every rank's ``obj`` in ``group`` (None: every rank), in rank order (``[obj]`` without a process group)."""
    if not _active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any, src: int = 0, *, group: Any = None) -> Any:
    """``obj`` from global rank ``src`` on every rank of ``group`` (None: every rank)."""
    if not _active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]
