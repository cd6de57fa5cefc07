"""Samplers for N ranks: a resumable training shard in any epoch order, and exact evaluation shards.

    sampler = ResumableDistributedSampler(dataset, num_replicas=2, rank=0, seed=0, order="auto")
    sampler.set_epoch(3, start_index=640)     # continue epoch 3 after this rank's first 640 samples
    list(sampler)                             # positions 0, 2, 4, ... of epoch 3's order, from the 640th on

Training: rank ``r`` of ``W`` takes positions ``r, r+W, r+2W, ...`` of the epoch's order (as
``DistributedSampler`` does, padding by wrapping around when ``drop_last`` is false). The order is
:func:`ddpkit.data.order.epoch_order`: ``randperm`` (``DistributedSampler``'s own order, bit for bit)
or the index-free permutation, which is computed a chunk of positions at a time and so never
holds the epoch in memory: a 10**9-sample epoch starts with a few kilobytes.

Evaluation (:class:`ExactShardSampler`): rank ``r`` sees samples ``r, r+W, r+2W, ...`` and nothing
else; shards differ by at most one sample and every sample is counted exactly once.
"""

from __future__ import annotations

import itertools
import random
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler, Sampler, get_worker_info

from ddpkit.data.order import epoch_order

__all__ = ["ResumableDistributedSampler", "ExactShardSampler", "SampleSeeded", "CHUNK", "tagged"]

#: Positions turned into indices per numpy call: large enough that the per-call cost vanishes
#: (about 40 ns a position at this size), small enough to be a few hundred kilobytes.
CHUNK = 8192


def tagged(indices: Iterable[int], epoch: int, tag_epoch: bool) -> Iterator[Any]:
    """``indices``, as ``(epoch, index)`` pairs when ``tag_epoch`` (see ``ResumableDistributedSampler.tag_epoch``)."""
    return zip(itertools.repeat(epoch), indices) if tag_epoch else iter(indices)


class ResumableDistributedSampler(DistributedSampler):
    """A ``DistributedSampler`` whose epoch can start at any sample position (for mid-epoch resume).

    ``order``: ``auto``, ``index_free`` or ``randperm`` (``data.order``; see :mod:`ddpkit.data.order`).
    """

    start_index = 0
    #: Yield ``(epoch, index)`` pairs: persistent worker processes keep their own copy of the
    #: dataset, so the epoch a sample is seeded with has to travel with its index.
    tag_epoch = False
    #: ``data.allow_length_change``: a resume onto a dataset of another length re-plans the epoch
    #: instead of refusing (checked by :class:`ddpkit.data.epochs.SampleOrder`).
    allow_length_change = False

    def __init__(self, dataset: Dataset, *args: Any, order: str = "auto", **kwargs: Any):
        # DistributedSampler's own arguments, unchanged.
        super().__init__(dataset, *args, **kwargs)
        self.order = order

    def set_epoch(self, epoch: int, start_index: int = 0) -> None:
        super().set_epoch(epoch)
        # min: a resume onto a shorter dataset (data.allow_length_change) may start past the new end: the epoch is over
        self.start_index = min(start_index, self.num_samples)

    def __iter__(self) -> Iterator[Any]:
        # chain.from_iterable walks each chunk's list in C: no Python frame per index
        return tagged(itertools.chain.from_iterable(self._chunks()), self.epoch, self.tag_epoch)

    def _chunks(self) -> Iterator[list[int]]:
        n = len(self.dataset)  # type: ignore[arg-type]
        world = self.num_replicas
        order = epoch_order(n, seed=self.seed, epoch=self.epoch, kind=self.order, shuffle=self.shuffle)
        first = self.rank + self.start_index * world
        for low in range(first, self.total_size, CHUNK * world):
            positions = np.arange(low, min(low + CHUNK * world, self.total_size), world)
            # % n: the padding wraps around, as in DistributedSampler.
            yield order.at(positions % n).tolist()

    def __len__(self) -> int:
        return self.num_samples - self.start_index


class ExactShardSampler(Sampler[int]):
    """Rank ``rank`` of ``world_size`` gets indices ``rank, rank + world_size, ...``: no padding, no duplicates."""

    def __init__(self, length: int, *, rank: int, world_size: int):
        self.indices = range(rank, length, world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class SampleSeeded(Dataset):
    """Seeds the worker's RNGs from ``(seed, epoch, index)`` before loading each sample."""

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset = dataset
        self.seed = seed
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: int | tuple[int, int]) -> Any:
        epoch, index = key if isinstance(key, tuple) else (self.epoch, key)
        # Only inside worker processes: never touch the main RNG.
        if get_worker_info() is not None:
            sample_seed = hash((self.seed, epoch, index)) & 0xFFFF_FFFF
            # The CPU generator only: what torch.manual_seed sets for the CPU, without also seeding
            # every accelerator backend, which costs up to milliseconds per call (per sample here).
            torch.default_generator.manual_seed(sample_seed)
            random.seed(sample_seed)
            if "numpy" in sys.modules:
                sys.modules["numpy"].random.seed(sample_seed)
        return self.dataset[index]
