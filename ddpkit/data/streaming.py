"""Streaming data: an ``IterableDataset`` on N ranks x W workers, equal step counts, exact resume.

    class MyTrainer(ddpkit.Trainer):
        def build_datasets(self):
            return MyStream(files), None       # an IterableDataset: no len(), reshuffled by set_epoch

The Trainer hands a stream to :func:`build_stream_loader` and iterates it with
:class:`StreamEpochs`; nothing else changes for the user. Three things make it exact:

* **Sharding** (:func:`shard_stream`): a dataset that shards itself is sharded its way (HF
  ``datasets`` by ``split_dataset_by_node``; a ``shard(rank, world_size)`` method; a
  ``webdataset`` pipeline by its own node/worker splitters); a plain stream is split round-robin
  over ``(rank, worker)`` slots, so every sample goes to exactly one slot, each slot reading the
  whole stream (blind to the workers: a stream written to split itself over DataLoader workers is
  read whole, so it is never split twice). The stream must yield the same order on every rank
  and worker for a given epoch (seed a shuffle from ``set_epoch``'s epoch, never the global RNG).
* **Equal step counts** (:class:`~ddpkit.data.stream_epochs.StreamEpochs`): each rank reads ahead a window of
  ``data.stream_window`` optimizer steps and the ranks agree on the window's length with one
  ``all_reduce(MIN)`` of one integer, so when one rank's shard ends every rank ends the epoch at
  the same step; the leftover (less than a global step) is dropped and counted in the log.
* **Exact resume**: torchdata's ``StatefulDataLoader`` keeps the worker round-robin state; the
  stream's own state is its batch count per worker, so a resume skips samples without collating
  them. A checkpoint stores the loader state at the current window's start; resuming restores it,
  re-reads the window (the same batches) and skips the ones already trained on.
"""

from __future__ import annotations

import functools
import itertools
import logging
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

# Private, for get_worker_info()'s global, which _read_whole hides from a source that splits itself.
import torch.utils.data._utils.worker as _worker_state
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info

from ddpkit.data.stream_epochs import StreamEpochs, Tail
from ddpkit.distributed.env import DistEnv
from ddpkit.errors import ConfigError, DdpkitError

__all__ = [
    "ShardedStream",
    "StreamEpochs",
    "shard_stream",
    "build_stream_loader",
    "build_stream_val_loader",
    "stream_total_steps",
    "stream_epochs_of",
    "is_stream",
    "UNKNOWN_LENGTH",
]

log = logging.getLogger("ddpkit")

#: Steps or batches per epoch of a stream whose length is not known (yet): larger than any real count.
UNKNOWN_LENGTH = sys.maxsize

#: Set this attribute to True on a stream that splits its samples over DataLoader workers itself.
SPLITS_WORKERS = "ddpkit_splits_workers"


def is_stream(dataset: Any) -> bool:
    """True for an ``IterableDataset`` (a stream): it goes through this module, not a sampler."""
    return isinstance(dataset, IterableDataset)


class ShardedStream(IterableDataset):
    """One rank's view of ``source``: its slots' samples, collated into batches of ``batch_size``.

    ``split_ranks`` / ``split_workers`` say which round-robin splits ddpkit still has to do (a
    source that shards itself did the rest). Its ``state_dict`` (read by ``StatefulDataLoader`` in
    each worker after each batch) is the number of batches that worker has produced.
    """

    def __init__(
        self,
        source: Any,
        *,
        rank: int,
        world_size: int,
        batch_size: int,
        drop_last: bool = True,
        split_ranks: bool = True,
        split_workers: bool = True,
        collate_fn: Callable[[list], Any] = default_collate,
        seed: int = 0,
    ):
        self.source = source
        self.rank = rank
        self.world_size = world_size
        self.batch_size = batch_size
        self.seed = seed
        self.drop_last = drop_last
        self.split_ranks = split_ranks
        self.split_workers = split_workers
        self.collate_fn = collate_fn
        self.epoch = 0
        self._yielded = 0
        self._ended = False
        self._resume: dict[str, Any] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch``: forwarded to the source's ``set_epoch`` (a shuffling stream reshuffles)."""
        self.epoch = epoch
        if callable(getattr(self.source, "set_epoch", None)):
            self.source.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "batches": self._yielded, "ended": self._ended}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resume = dict(state)

    def _slot(self) -> tuple[int, int]:
        """``(slot, slots)``: this process's place among the round-robin readers of the source."""
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None and self.split_workers else (0, 1)
        ranks = self.world_size if self.split_ranks else 1
        return (self.rank if self.split_ranks else 0) * workers + worker, ranks * workers

    def __iter__(self) -> Iterator[Any]:
        resume = self._resume or {"batches": 0, "ended": False}
        self._resume = None
        self._yielded = resume["batches"]
        self._ended = resume["ended"]
        if self._ended:
            return
        slot, slots = self._slot()
        source = _read_whole(self.source) if self.split_workers and get_worker_info() is not None else iter(self.source)
        samples = source if slots == 1 else itertools.islice(source, slot, None, slots)
        skip = self._yielded
        for number in itertools.count():
            batch = list(itertools.islice(samples, self.batch_size))
            if len(batch) < self.batch_size:
                self._ended = True
                if batch:
                    yield Tail(len(batch)) if self.drop_last else self.collate_fn(batch)
                return
            # Resume: what earlier batches used is read again but not collated.
            if number < skip:
                continue
            # Counted before the yield: the state read after this batch includes it.
            self._yielded = number + 1
            yield self.collate_fn(batch)


def shard_stream(
    dataset: Any, *, env: DistEnv, batch_size: int, drop_last: bool = True, seed: int = 0
) -> ShardedStream:
    """Shard ``dataset`` over ranks its own way if it has one, else round-robin; see the module doc."""
    rank = env.rank
    world = env.world_size
    module = type(dataset).__module__.split(".")[0]
    splits_workers = bool(getattr(dataset, SPLITS_WORKERS, False))
    # Hugging Face datasets, streaming.
    if module == "datasets" and hasattr(dataset, "n_shards"):
        from datasets.distributed import split_dataset_by_node

        dataset = split_dataset_by_node(dataset, rank=rank, world_size=world)
        split_ranks = False
        splits_workers = True
    elif module == "webdataset":
        # Its nodesplitter / workersplitter (as the user built it) decide.
        split_ranks = False
        splits_workers = True
        _note_once(
            f"{type(dataset).__name__}: sharded by its own nodesplitter and workersplitter (give it wds.split_by_node)"
        )
    elif callable(getattr(dataset, "shard", None)):
        sharded = dataset.shard(rank, world)
        dataset = dataset if sharded is None else sharded
        split_ranks = False
    else:
        split_ranks = world > 1
        _note_once(
            f"{type(dataset).__name__} has no shard(rank, world_size): split round-robin over ranks and workers, "
            "so every rank and worker reads the whole stream and keeps its share"
        )
    return ShardedStream(
        dataset,
        rank=rank,
        world_size=world,
        batch_size=batch_size,
        drop_last=drop_last,
        split_ranks=split_ranks,
        split_workers=not splits_workers,
        seed=seed,
    )


def _read_whole(source: Any) -> Iterator[Any]:
    """``source``'s samples, read with ``get_worker_info()`` returning None inside it.

    ddpkit splits this stream over the workers itself; a stream written for DataLoader workers
    (PyTorch's pattern: each worker reads only its part) would otherwise be split twice and lose
    data. Blind to the workers, it yields everything, and the round-robin split stays exact.
    Plain assignments, not a context manager: this runs once per sample (under 1 us here).
    """
    info = _worker_state._worker_info
    _worker_state._worker_info = None
    try:
        iterator = iter(source)
    finally:
        _worker_state._worker_info = info
    while True:
        _worker_state._worker_info = None
        try:
            sample = next(iterator, _END)
        finally:
            _worker_state._worker_info = info
        if sample is _END:
            return
        yield sample


_END = object()


@functools.cache
def _note_once(message: str) -> None:
    log.info("streaming: %s", message)


def build_stream_loader(
    dataset: Any,
    *,
    env: DistEnv,
    batch_size: int,
    num_workers: int = 0,
    pin_memory: bool = False,
    seed: int = 0,
    accum: int = 1,
    window_steps: int = 8,
    uneven: str = "error",
    **loader_kwargs: Any,
) -> DataLoader:
    """A resumable training loader over this rank's shard of ``dataset`` (batches made by the stream).

    ``accum`` and ``window_steps`` (``data.stream_window``): the read-ahead window, in whole
    optimizer steps; ``uneven`` (``data.uneven``): what an epoch end with a whole window left on
    some rank does (see :mod:`ddpkit.data.uneven`). Its ``stream_epochs`` attribute
    (:func:`stream_epochs_of`) is the :class:`StreamEpochs` that the Trainer iterates instead of the
    loader itself.

    Raises:
        DdpkitError: torchdata (the ``stream`` extra) is not installed.
    """
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        raise DdpkitError(
            "training on an IterableDataset needs torchdata's StatefulDataLoader for exact mid-epoch resume: "
            "pip install 'ddpkit[stream]'. Or return a map-style Dataset (with __len__) from build_datasets / "
            "data.name."
        ) from None
    stream = shard_stream(dataset, env=env, batch_size=batch_size, drop_last=True, seed=seed)
    # A fresh worker per epoch sees set_epoch's epoch.
    loader_kwargs.pop("persistent_workers", None)
    # torchdata 0.11 calls torch.set_vital, deprecated in newer torch: not the user's concern
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*set_vital.*")
        loader = StatefulDataLoader(
            stream,
            batch_size=None,
            num_workers=num_workers,
            pin_memory=pin_memory,
            generator=torch.Generator(),
            **loader_kwargs,
        )
    loader.stream_epochs = StreamEpochs(loader, accum=accum, window_steps=window_steps, uneven=uneven)
    return loader


def stream_epochs_of(loader: Any) -> StreamEpochs | None:
    """The :class:`StreamEpochs` of a loader made by :func:`build_stream_loader`; None for any other loader."""
    return getattr(loader, "stream_epochs", None)


def build_stream_val_loader(
    dataset: Any, *, env: DistEnv, batch_size: int, num_workers: int = 0, pin_memory: bool = False
) -> DataLoader:
    """An evaluation loader: every sample of the stream counted on exactly one rank, nothing dropped."""
    stream = shard_stream(dataset, env=env, batch_size=batch_size, drop_last=False)
    return DataLoader(stream, batch_size=None, num_workers=num_workers, pin_memory=pin_memory)


def stream_total_steps(
    *, max_steps: int | None, epochs: int | None, steps_per_epoch: int | None, sched_name: str
) -> int | None:
    """Training length in optimizer steps, or None while a stream's epoch length is unknown.

    Raises:
        ConfigError: the schedule needs a length (cosine, linear) and neither ``train.max_steps``
            nor a learned epoch length gives one.
    """
    lengths = [n for n in (max_steps, epochs * steps_per_epoch if epochs and steps_per_epoch else None) if n]
    if lengths:
        return min(lengths)
    if sched_name in ("cosine", "linear"):
        raise ConfigError(
            f"train.max_steps: sched.name={sched_name} needs the run's length in steps, but the training set is a "
            "stream without len(); set train.max_steps (e.g. train.max_steps=1000) or use sched.name=constant / step"
        )
    return None
