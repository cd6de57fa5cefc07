"""Uneven inputs never hang: the ranks compare their batch counts before DDP's all-reduces can.

    data: {uneven: error}       # the default: a clear DataError naming every rank's count
    data: {uneven: truncate}    # every rank stops at the shortest rank's count

A rank with one batch more than its peers waits forever in an all-reduce the others never join
(Lightning #20404, litData #233, HF datasets #6623). ddpkit compares counts where they are known:

* a loader with ``len()``: once per epoch, one small all-gather of one integer per rank
  (:func:`agree_on_count`);
* a loader without ``len()`` (a custom ``DataLoader`` over an ``IterableDataset``): before each
  batch, one all-reduce of two integers says whether every rank has a batch (:func:`agreed_batches`);
* a ddpkit stream (:mod:`ddpkit.data.stream_epochs`): at its read-ahead windows, as before; at the
  epoch's end a rank that still had a whole window left is uneven (:func:`uneven_stream_end`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.distributed.collectives import all_gather_object
from ddpkit.errors import DataError

__all__ = ["agree_on_count", "agreed_batches", "uneven_stream_end", "grouped", "group_device"]

log = logging.getLogger("ddpkit")


def grouped() -> bool:
    """True inside a process group of more than one rank (a collective is needed and possible)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def group_device() -> torch.device:
    """Where the group's tensors live: NCCL reduces CUDA tensors, Gloo CPU ones."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _describe(counts: list[Any]) -> str:
    return ", ".join(f"rank {rank}: {count}" for rank, count in enumerate(counts))


def _uneven_error(counts: list[Any], *, epoch: int | None, shortest: int) -> DataError:
    when = "per epoch" if epoch is None else f"in epoch {epoch}"
    return DataError(
        f"data.uneven: error, and the ranks would run different numbers of training batches {when} "
        f"({_describe(counts)}). DDP needs the same number on every rank: a rank with more would wait forever in "
        f"all-reduce. Give every rank the same number of samples (e.g. a sampler with drop_last=True), or set "
        f"data.uneven=truncate to stop every rank after {shortest} batches."
    )


def agree_on_count(count: int, *, epoch: int | None, uneven: str = "error") -> int:
    """``count`` if every rank has the same; else a DataError (``error``) or the smallest (``truncate``).

    ``epoch``: for the messages; None when agreeing on the run's length before training.

    One all-gather of one integer per rank. Every rank raises the same error, so none is left waiting.
    """
    counts = all_gather_object(count)
    shortest = min(counts)
    if shortest != max(counts):
        if uneven != "truncate":
            raise _uneven_error(counts, epoch=epoch, shortest=shortest)
        log.warning(
            "data.uneven=truncate: uneven batch counts %s (%s); every rank runs %d",
            "per epoch" if epoch is None else f"in epoch {epoch}",
            _describe(counts),
            shortest,
        )
    if shortest == 0:
        raise DataError(
            "the training loader yields no batches on some rank "
            f"({_describe(counts)}); check the dataset and data.batch_size"
        )
    return shortest


def agreed_batches(batches: Iterator[Any], *, epoch: int, uneven: str = "error") -> Iterator[Any]:
    """``batches`` until the first rank runs out: before each batch the ranks agree that all have one.

    For loaders without ``len()``: one all-reduce (MIN of ``[has, -has]``) per batch. When some
    ranks are out and others are not: a DataError naming every rank's count (``error``), or the
    epoch ends on every rank (``truncate``).
    """
    done = 0
    for batch in _with_end_marker(batches):
        has = batch is not _END
        low, high = _min_max(int(has)) if grouped() else (int(has), int(has))
        if low == high == 1:
            done += 1
            yield batch
            continue
        if low != high and uneven != "truncate":
            counts = all_gather_object(f"{done} then more" if has else str(done))
            raise _uneven_error(counts, epoch=epoch, shortest=done)
        return


_END = object()


def _with_end_marker(batches: Iterator[Any]) -> Iterator[Any]:
    """``batches`` followed by one ``_END``: a finished rank keeps taking part in the agreement once more."""
    yield from batches
    yield _END


def _min_max(value: int) -> tuple[int, int]:
    """The smallest and largest ``value`` over ranks, with one all-reduce."""
    box = torch.tensor([value, -value], dtype=torch.int64, device=group_device())
    dist.all_reduce(box, op=dist.ReduceOp.MIN)
    return int(box[0]), -int(box[1])


def uneven_stream_end(reads: list[tuple[int, bool]], *, epoch: int, ended_at: int, uneven: str) -> None:
    """At a stream's epoch end: raise if some rank still had a whole read-ahead window unread (``error``).

    ``reads``: each rank's ``(batches read, more left unread)``. A stream's shards end a few batches
    apart even when balanced (round-robin over ranks and workers); a whole window more is a
    shard imbalance that truncating would silently drop.
    """
    if uneven == "truncate" or not any(unread for _, unread in reads):
        return
    counts = [f"{count}{' or more' if unread else ''}" for count, unread in reads]
    raise _uneven_error(counts, epoch=epoch, shortest=ended_at)
