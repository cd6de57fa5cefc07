"""Uneven inputs never hang: ranks with different batch counts stop with every count, or all stop at the shortest.

Real Gloo ranks (2 and 3) train a Trainer whose ``build_train_loader`` gives rank ``r`` more batches
than rank 0: through a custom sampler (a ``len()`` the ranks compare before the epoch) and through
a plain ``DataLoader`` over an ``IterableDataset`` without ``len()`` (the ranks agree batch by batch).
Each spawn runs all four cases (``data.uneven``: error / truncate) one after another.
"""

from __future__ import annotations

import pytest
import torch
from helpers import run_in_pool, tiny_config
from torch.utils.data import DataLoader, IterableDataset, Sampler

import ddpkit
from ddpkit.errors import DataError

pytestmark = pytest.mark.multiprocess

BATCH = 16


def _batches_of(rank: int) -> int:
    return 4 + rank  # rank 0: 4 batches, rank 1: 5, rank 2: 6


class UnevenSampler(Sampler[int]):
    """A custom sampler that forgets to even out its shards: rank r gets 4 + r batches."""

    def __init__(self, rank: int):
        self.rank = rank

    def __iter__(self):
        return iter(range(self.rank, self.rank + _batches_of(self.rank) * BATCH))

    def __len__(self) -> int:
        return _batches_of(self.rank) * BATCH


class UnevenSource(IterableDataset):
    """An iterable source with an uneven shard per rank and no ``len()``."""

    def __init__(self, dataset, rank: int):
        self.dataset, self.rank = dataset, rank

    def __iter__(self):
        return (self.dataset[i] for i in range(_batches_of(self.rank) * BATCH))


class UnevenTrainer(ddpkit.Trainer):
    kind = "sampler"

    def build_train_loader(self, dataset):
        if self.kind == "sampler":
            return DataLoader(dataset, batch_size=BATCH, sampler=UnevenSampler(self.rank))
        return DataLoader(UnevenSource(dataset, self.rank), batch_size=BATCH)


def _run_cases(tmp):
    out = {}
    for kind in ("sampler", "iterable"):
        for uneven in ("error", "truncate"):
            trainer = UnevenTrainer(tiny_config(tmp / f"{kind}-{uneven}", data={"uneven": uneven}, train={"epochs": 2}))
            trainer.kind = kind
            try:
                out[kind, uneven] = ("steps", trainer.fit()["step"])
            except DataError as error:
                out[kind, uneven] = ("error", str(error))
            torch.distributed.barrier()
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_uneven_batch_counts_stop_every_rank_with_the_counts_or_truncate_to_the_shortest(tmp_path, world_size):
    results = run_in_pool(_run_cases, world_size=world_size, args=(tmp_path,), timeout=180)
    expected_counts = ", ".join(f"rank {r}: {_batches_of(r)}" for r in range(world_size))
    for rank_result in results:
        kind, message = rank_result["sampler", "error"]
        assert (
            kind == "error"
            and expected_counts in message
            and "per epoch" in message
            and "data.uneven=truncate" in message
        ), message
        kind, message = rank_result["iterable", "error"]
        # the ranks learn of it at the 5th batch: rank 0 has run out, the others have one more
        assert kind == "error" and "rank 0: 4, rank 1: 4 then more" in message, message
        assert rank_result["sampler", "truncate"] == ("steps", 2 * 4)  # two epochs of rank 0's 4 batches
        assert rank_result["iterable", "truncate"] == ("steps", 2 * 4)
    assert len({str(r) for r in results}) == 1  # every rank saw the same outcome
