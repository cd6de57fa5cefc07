"""The arithmetic of the health checks, with no collective and no Trainer: easy to test alone.

    spikes = SpikeDetector(sigma=6, window=128, warmup=20)
    spikes.is_spike(loss)          # True when loss > mean + 6 std of the last 128 recorded values
    spikes.add(loss)
    fingerprint(model.parameters())            # int64[2]: exact, order-sensitive
    slower_ranks([10.0, 13.8], margin=0.25)    # [(1, 0.38)]: rank 1 is 38% slower than the others' median
    sample_indices(loader, epoch=0, first_batch=3, count=2)   # the dataset indices of batches 3 and 4
    poison_nonfinite(loss)         # the loss to backpropagate: itself, or NaN (so every gradient is NaN) if not finite
    watched(pipeline_loss)         # a pipeline's last-stage loss function, poisoned so

:mod:`ddpkit.training.health` runs them at the step every rank agrees on.
"""

from __future__ import annotations

import copy
import functools
import itertools
import math
import statistics
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["SpikeDetector", "fingerprint", "slower_ranks", "sample_indices", "poison_nonfinite", "watched"]

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: Combines per-tensor sums so that the order of the tensors matters too.
_MIX = 1_000_003


def poison_nonfinite(loss: torch.Tensor) -> torch.Tensor:
    """The loss to backpropagate: the same value, with NaN gradients if it is not finite.

    A non-finite loss need not make its gradients non-finite (``loss + NaN`` backpropagates 1), and the ranks
    agree that a step is bad through its gradient norm, so a bad loss must poison the gradients. On an accelerator
    the guard is ``loss * (loss * 0 + 1)``, with no host sync. A scalar loss on the CPU is read instead (about 1 us,
    where the guard's three operations and its node in the backward measured 30 us a step on the MLP) and
    multiplied by NaN only when it is not finite: the same gradients, bit for bit, either way.
    """
    detached = loss.detach()
    if detached.is_cpu and detached.numel() == 1:
        return loss if math.isfinite(detached.item()) else loss * math.nan
    return loss * (detached * 0 + 1)


def watched(loss_fn: Callable[[torch.Tensor, Any], torch.Tensor]) -> Callable[[torch.Tensor, Any], torch.Tensor]:
    """A pipeline's loss function ``loss_fn(output, target)`` with :func:`poison_nonfinite` applied.

    Under a pipeline torch's schedule runs the backward itself, so the guard goes into the loss function it
    calls on the last stage: a NaN there reaches every stage's gradients through the backward's sends, and every
    replica's through the data-parallel reduction, as it does without a pipeline.
    """

    @functools.wraps(loss_fn)
    def guarded(output: torch.Tensor, target: Any) -> torch.Tensor:
        return poison_nonfinite(loss_fn(output, target))

    return guarded


class SpikeDetector:
    """A value more than ``sigma`` standard deviations above the mean of a rolling window."""

    def __init__(self, *, sigma: float, window: int, warmup: int):
        self.sigma = sigma
        self.warmup = warmup
        self.values: deque[float] = deque(maxlen=window)

    def is_spike(self, value: float) -> bool:
        """Whether ``value`` is a spike (never during the first ``warmup`` recorded values)."""
        if len(self.values) < self.warmup:
            return False
        mean = statistics.fmean(self.values)
        std = statistics.pstdev(self.values, mean)
        return value > mean + self.sigma * std

    def add(self, value: float) -> None:
        """Record a healthy value (spikes and non-finite values are left out, so they cannot widen the window)."""
        self.values.append(value)

    def state_dict(self) -> dict[str, Any]:
        return {"values": list(self.values)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.values.clear()
        self.values.extend(state.get("values", []))


def fingerprint(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """An exact, order-sensitive fingerprint of ``tensors``' bytes: int64[2] on their device.

    Each tensor's bits are read as integers and summed with odd position weights (``1, 3, 5, ...``),
    in int64 arithmetic that wraps identically everywhere; the per-tensor sums are combined as a
    polynomial, so swapping two values or two tensors changes it. Not ``torch.hash_tensor``: its XOR
    reduction cancels a value that appears twice. The second number is the plain sum of the bits.
    """
    weighted = None
    for tensor in tensors:
        flat = tensor.detach().reshape(-1)
        if flat.numel() == 0:
            continue
        bits = flat.view(_INT_VIEW[flat.element_size()]).to(torch.int64)
        weights = torch.arange(1, 2 * bits.numel(), 2, dtype=torch.int64, device=bits.device)
        pair = torch.stack([(bits * weights).sum(), bits.sum()])
        weighted = pair if weighted is None else weighted * _MIX + pair
    return weighted if weighted is not None else torch.zeros(2, dtype=torch.int64)


def slower_ranks(times: list[float], *, margin: float, floor: float = 0.0) -> list[tuple[int, float]]:
    """``(rank, fraction)`` for each rank whose time exceeds the median of the other ranks' by more than
    ``margin`` (a fraction) and by more than ``floor`` (in the times' unit).

    The other ranks' median, not all ranks': at two ranks the median of both would halve the gap.
    """
    slow = []
    for rank, own in enumerate(times):
        others = times[:rank] + times[rank + 1 :]
        if not others:
            continue
        reference = statistics.median(others)
        if reference > 0 and math.isfinite(own) and own > reference * (1 + margin) and own - reference > floor:
            slow.append((rank, own / reference - 1))
    return slow


def sample_indices(loader: Any, *, epoch: int, first_batch: int, count: int) -> list[int] | None:
    """The dataset indices of batches ``first_batch .. first_batch + count - 1`` of ``epoch`` on this rank.

    Read from a copy of the loader's sampler started at the epoch's beginning (the original, in
    use, is untouched); None when the loader has no sampler that can say (a stream, a custom one).
    """
    sampler = getattr(loader, "sampler", None)
    batch_size = getattr(loader, "batch_size", None)
    if batch_size is None or not hasattr(sampler, "set_epoch") or not hasattr(sampler, "epoch"):
        return None
    replay = copy.copy(sampler)
    for name, start in (("start_index", 0), ("start_step", 0), ("tag_epoch", False)):
        if hasattr(replay, name):
            setattr(replay, name, start)
    replay.epoch = epoch
    try:
        return [
            int(i) for i in itertools.islice(iter(replay), first_batch * batch_size, (first_batch + count) * batch_size)
        ]
    except Exception:
        # A sampler that cannot be replayed: the log goes without indices, training goes on.
        return None
