"""A training order that does not depend on the world size, so a run can resume on more or fewer ranks.

    data: {global_batch_size: 128}          # instead of data.batch_size (per rank)

With ``data.global_batch_size`` = G, optimizer step ``k`` of an epoch trains on the same G
samples at 1, 2, 3 or 4 ranks: positions ``k*G .. (k+1)*G - 1`` of a permutation that depends
only on ``(run.seed, epoch)``. Each rank takes its share of them, ``G / (world_size *
grad_accum_steps)`` samples per micro-batch, and DDP's gradient average over ranks times the
accumulation average gives the mean over all G samples, as on one rank. A checkpoint written on
N ranks therefore resumes on M ranks at the exact sample position, mid-epoch included.

What cannot carry over: each rank's random streams (dropout masks, augmentation in the main
process) are per rank, so after a world-size change every rank continues from rank 0's saved
stream. Weights then match an uninterrupted run up to floating-point reduction order (and
batch-dependent layers such as BatchNorm see per-rank batches of another size), not bitwise.
Samples seeded per index in DataLoader workers (``data.num_workers > 0``) are the same at any
world size.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
from torch.utils.data import Dataset, DistributedSampler

from ddpkit.data.order import epoch_order
from ddpkit.data.samplers import CHUNK, tagged
from ddpkit.errors import ConfigError, DataError

__all__ = ["per_rank_batch_size", "GlobalBatchSampler"]


def per_rank_batch_size(data: Any, *, world_size: int, grad_accum_steps: int) -> int:
    """``data.batch_size``, or ``data.global_batch_size / (world_size x grad_accum_steps)`` when that is set."""
    total = data.global_batch_size
    if total is None:
        return data.batch_size
    shares = world_size * grad_accum_steps
    if total % shares:
        raise ConfigError(
            f"data.global_batch_size: {total} does not divide into {world_size} rank(s) x {grad_accum_steps} "
            f"accumulation step(s) = {shares} equal micro-batches; use a multiple of {shares} "
            f"(e.g. {max(shares, total // shares * shares)}) or another number of processes"
        )
    return total // shares


class GlobalBatchSampler(DistributedSampler):
    """This rank's indices, global batch by global batch, in a world-size-independent order.

    Yields, for each optimizer step ``k`` and micro-batch ``a``, this rank's slice of global batch
    ``k``: ``b = G / (world_size * accum)`` indices starting at ``k*G + (a*world_size + rank)*b``.
    The tail of an epoch that cannot fill a global batch is dropped. ``set_epoch(epoch,
    start_index)`` starts part-way through (``start_index`` counts this rank's samples, as
    :func:`ddpkit.data.epochs.start_epoch` passes it), which must fall on an optimizer-step boundary.
    """

    #: As on :class:`ddpkit.data.samplers.ResumableDistributedSampler`, which says what each does.
    tag_epoch = False
    #: Likewise.
    allow_length_change = False

    def __init__(
        self,
        dataset: Dataset,
        *,
        global_batch_size: int,
        rank: int,
        world_size: int,
        grad_accum_steps: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        order: str = "auto",
    ):
        super().__init__(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)
        # data.order: see ddpkit.data.order.
        self.order = order
        self.global_batch_size = global_batch_size
        self.grad_accum_steps = grad_accum_steps
        self.micro_batch = global_batch_size // (world_size * grad_accum_steps)
        self.steps_per_epoch = len(dataset) // global_batch_size  # type: ignore[arg-type]
        if self.steps_per_epoch == 0:
            raise DataError(
                f"the training set has {len(dataset)} samples, fewer "
                f"than data.global_batch_size ({global_batch_size}): "  # type: ignore[arg-type]
                "not one optimizer step fits. Use a smaller data.global_batch_size."
            )
        self.start_step = 0

    def set_epoch(self, epoch: int, start_index: int = 0) -> None:
        super().set_epoch(epoch)
        per_step = self.micro_batch * self.grad_accum_steps
        if start_index % per_step:
            raise DataError(
                f"cannot resume at sample {start_index} of this rank's epoch: "
                f"not an optimizer-step boundary ({per_step} samples a step)"
            )
        # min: a resume onto a shorter dataset (data.allow_length_change) may start past the new end: the epoch is over
        self.start_step = min(start_index // per_step, self.steps_per_epoch)

    def __iter__(self) -> Iterator[Any]:
        n = len(self.dataset)  # type: ignore[arg-type]
        order = epoch_order(n, seed=self.seed, epoch=self.epoch, kind=self.order, shuffle=self.shuffle)
        steps_per_chunk = max(1, CHUNK // (self.grad_accum_steps * self.micro_batch))
        chunks = (
            order.at(self._positions(step, min(step + steps_per_chunk, self.steps_per_epoch))).tolist()
            for step in range(self.start_step, self.steps_per_epoch, steps_per_chunk)
        )
        return tagged(itertools.chain.from_iterable(chunks), self.epoch, self.tag_epoch)

    def _positions(self, first_step: int, stop_step: int) -> np.ndarray:
        """This rank's positions in steps ``[first_step, stop_step)``: step, micro-batch, then sample order."""
        b = self.micro_batch
        world = self.num_replicas
        steps = np.arange(first_step, stop_step).reshape(-1, 1, 1) * self.global_batch_size
        micro = (np.arange(self.grad_accum_steps).reshape(1, -1, 1) * world + self.rank) * b
        return (steps + micro + np.arange(b).reshape(1, 1, -1)).reshape(-1)

    def __len__(self) -> int:
        return (self.steps_per_epoch - self.start_step) * self.grad_accum_steps * self.micro_batch
