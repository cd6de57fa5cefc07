"""The Trainer's epoch protocol over any training loader: start, agree on a length, iterate, save a position.

    start_epoch(loader, epoch, start_batch=batch_in_epoch)          # reseed, skip what a resume already did
    count = agree_on_batch_count(loader, epoch=epoch, consumed=batch_in_epoch, uneven="error")
    for batch in exact_batches(loader, count=count, rank=rank, epoch=epoch, consumed=batch_in_epoch): ...

Two kinds of loader answer the protocol: a ddpkit stream loader (its :class:`StreamEpochs`,
which agrees as it reads) and any other ``DataLoader`` (:class:`SamplerEpochs`, which agrees on
``len()`` up front, or batch by batch when there is no ``len()``). :func:`epochs_of` is the one
place that tells them apart.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, NamedTuple

from torch.utils.data import DataLoader, DistributedSampler

from ddpkit.config.schema import Config
from ddpkit.data.elastic import GlobalBatchSampler
from ddpkit.data.order import order_kind
from ddpkit.data.samplers import ResumableDistributedSampler, SampleSeeded
from ddpkit.data.stream_epochs import StreamEpochs
from ddpkit.data.streaming import UNKNOWN_LENGTH, stream_epochs_of, stream_total_steps
from ddpkit.data.uneven import agree_on_count, agreed_batches
from ddpkit.errors import CheckpointError, DataError
from ddpkit.progress import Progress

__all__ = [
    "SamplerEpochs",
    "take_batches",
    "epochs_of",
    "start_epoch",
    "agree_on_batch_count",
    "exact_batches",
    "epoch_batches",
    "run_length",
    "SampleOrder",
    "data_position",
]


class SamplerEpochs:
    """The epoch protocol of a map-style ``DataLoader`` (or any loader that is not a ddpkit stream)."""

    def __init__(self, loader: DataLoader):
        self.loader = loader

    @property
    def length(self) -> int | None:
        """Batches per epoch from here on (``len(loader)``), or None for a loader without ``len()``."""
        try:
            return len(self.loader)
        except TypeError:
            # A DataLoader over an IterableDataset without __len__.
            return None

    def start_epoch(self, epoch: int, *, start_batch: int = 0) -> None:
        loader = self.loader
        sampler = self.loader.sampler
        if isinstance(sampler, (ResumableDistributedSampler, GlobalBatchSampler)):
            sampler.set_epoch(epoch, start_batch * (loader.batch_size or 1))
        elif isinstance(sampler, DistributedSampler) or hasattr(sampler, "set_epoch"):
            if start_batch:
                raise DataError(
                    f"cannot resume mid-epoch with a {type(sampler).__name__}: it cannot skip samples. "
                    "Use ddpkit.data.samplers.ResumableDistributedSampler or checkpoint only at epoch ends."
                )
            sampler.set_epoch(epoch)  # type: ignore[union-attr]
        # Workers seed each sample from (seed, epoch, index).
        if isinstance(loader.dataset, SampleSeeded):
            loader.dataset.epoch = epoch
        if loader.generator is not None:
            seed = sampler.seed if isinstance(sampler, DistributedSampler) else 0
            loader.generator.manual_seed(seed * 1_000_003 + epoch)

    def agree_on_count(self, *, epoch: int, consumed: int, uneven: str) -> int:
        length = self.length
        return UNKNOWN_LENGTH if length is None else agree_on_count(consumed + length, epoch=epoch, uneven=uneven)

    def batches(self, *, count: int, rank: int, epoch: int, consumed: int, uneven: str) -> Iterator[Any]:
        # No len(): the ranks agree batch by batch.
        if count == UNKNOWN_LENGTH:
            yield from agreed_batches(iter(self.loader), epoch=epoch, uneven=uneven)
            return
        batches = iter(self.loader)
        for position in range(consumed, count):
            batch = next(batches, None)
            if batch is None:
                raise DataError(
                    f"rank {rank}'s training loader ended after {position} batches of epoch {epoch}, "
                    f"but its len() promised {count}; fix the sampler's __len__"
                )
            yield batch


def epochs_of(loader: DataLoader) -> StreamEpochs | SamplerEpochs:
    """The epoch protocol of ``loader``: its :class:`StreamEpochs` for a ddpkit stream, else a
    :class:`SamplerEpochs`."""
    return stream_epochs_of(loader) or SamplerEpochs(loader)


def start_epoch(loader: DataLoader, epoch: int, *, start_batch: int = 0) -> None:
    """Prepare ``loader`` for ``epoch``, skipping the first ``start_batch`` batches (resume)."""
    epochs_of(loader).start_epoch(epoch, start_batch=start_batch)


def agree_on_batch_count(loader: DataLoader, *, epoch: int, consumed: int, uneven: str = "error") -> int:
    """This epoch's batch count (``consumed`` already done plus what ``loader`` yields), the same on every rank.

    DDP needs every rank to run the same number of backward passes. Uneven counts stop every rank
    with each rank's count (``uneven="error"``) or cut every rank to the shortest (``"truncate"``);
    see :mod:`ddpkit.data.uneven`. UNKNOWN_LENGTH for a stream or a loader without ``len()``: their
    ranks agree as they read, and their batches end on every rank at once.
    """
    return epochs_of(loader).agree_on_count(epoch=epoch, consumed=consumed, uneven=uneven)


def exact_batches(
    loader: DataLoader, *, count: int, rank: int, epoch: int, consumed: int, uneven: str = "error"
) -> Iterator[Any]:
    """The next ``count - consumed`` batches of ``loader``; a DataError if it ends before its len() promised."""
    return epochs_of(loader).batches(count=count, rank=rank, epoch=epoch, consumed=consumed, uneven=uneven)


def epoch_batches(
    loader: DataLoader, *, epoch: int, consumed: int, rank: int, uneven: str = "error"
) -> tuple[Iterator[Any], int]:
    """Start ``epoch`` after the ``consumed`` batches a resume skips: (this rank's batches, the agreed count).

    The three steps every epoch takes, in order: :func:`start_epoch`, :func:`agree_on_batch_count`
    (every rank runs the same number of batches), :func:`exact_batches`.
    """
    start_epoch(loader, epoch, start_batch=consumed)
    count = agree_on_batch_count(loader, epoch=epoch, consumed=consumed, uneven=uneven)
    return exact_batches(loader, count=count, rank=rank, epoch=epoch, consumed=consumed, uneven=uneven), count


class RunLength(NamedTuple):
    """A run's length in optimizer steps: one epoch's, and the whole run's (``train.max_steps`` / epochs)."""

    steps_per_epoch: int
    total_steps: int


def run_length(loader: DataLoader, config: Config, *, short_steps: bool = True) -> RunLength:
    """``(steps_per_epoch, total_steps)`` of a training run; UNKNOWN_LENGTH where the loader cannot say.

    The ranks agree on the epoch length first (``data.uneven``), so every rank's schedule has the same length.
    ``train.max_steps`` alone is the length however many epochs it spans; ``train.epochs`` alone, or neither
    (one epoch), is whole epochs; both: whichever ends first (``TrainConfig.epoch_limit``).
    ``short_steps``: whether an epoch's last step may take fewer than ``grad_accum_steps`` batches.
    """
    train = config.train
    length = epochs_of(loader).length
    if length is not None:
        length = agree_on_count(length, epoch=None, uneven=config.data.uneven)
    if length is None:
        total = stream_total_steps(
            max_steps=train.max_steps, epochs=train.epoch_limit, steps_per_epoch=None, sched_name=config.sched.name
        )
        return RunLength(UNKNOWN_LENGTH, total or UNKNOWN_LENGTH)
    # An epoch's last step may take fewer batches (accumulation); a pipeline's needs them all (short_steps=False).
    if short_steps:
        steps_per_epoch = math.ceil(length / train.grad_accum_steps)
    else:
        steps_per_epoch = length // train.grad_accum_steps
    return RunLength(
        steps_per_epoch, int(min(train.max_steps or math.inf, (train.epoch_limit or math.inf) * steps_per_epoch))
    )


def data_position(loader: DataLoader) -> dict[str, Any]:
    """Checkpoint components for where the loader is: a stream's window state; for ddpkit's samplers
    the order they draw (the Trainer's ``Progress.batch_in_epoch`` is all the position a map-style loader needs)."""
    stream = stream_epochs_of(loader)
    if stream is not None:
        return {"data_position": stream}
    sampler = getattr(loader, "sampler", None)
    if isinstance(sampler, (ResumableDistributedSampler, GlobalBatchSampler)):
        n = len(sampler.dataset)  # type: ignore[arg-type]
        resolved = order_kind(sampler.order, n) if sampler.shuffle else "sequential"
        return {"data_order": SampleOrder(resolved, length=n, allow_length_change=sampler.allow_length_change)}
    return {}


class SampleOrder:
    """The epoch order a map-style run draws (``data.order`` resolved for its size), checked on resume.

    ``data.order: auto`` means ``randperm`` below 2^20 samples and ``index_free`` from there on, so
    the same config can mean two orders; a checkpoint records which one its run used, and resuming
    with the other is refused (the samples of the rest of the epoch would differ).

    It also records the training set's length: a dataset that grew or shrank since the checkpoint
    would draw another order from the same position (samples seen twice, others never), so a resume
    onto another length is refused with both lengths, unless ``data.allow_length_change: true``
    (then the epoch is re-planned: the resumed run continues at the same batch of the new length's
    order, and a warning says so). Checkpoints from before the length was recorded are not checked."""

    def __init__(self, resolved: str, *, length: int | None = None, allow_length_change: bool = False):
        self.resolved = resolved
        self.length = length
        self.allow_length_change = allow_length_change

    def state_dict(self) -> dict[str, Any]:
        return {"order": self.resolved} if self.length is None else {"order": self.resolved, "length": self.length}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["order"] != self.resolved:
            raise CheckpointError(
                f"the checkpoint's run drew its samples in {state['order']!r} "
                f"order, this one would use {self.resolved!r} "
                f"(data.order=auto picks by the dataset's size): set data.order={state['order']} to resume it exactly"
            )
        saved_length = state.get("length")
        if saved_length is not None and self.length is not None and saved_length != self.length:
            if not self.allow_length_change:
                raise CheckpointError(
                    f"the training set has {self.length} samples, but the checkpoint's run trained on {saved_length}: "
                    "resuming would continue another epoch order from the same position (samples repeated or skipped). "
                    "Restore the dataset, start a new run (another run.name), "
                    "or set data.allow_length_change=true to re-plan the epoch"
                )
            logging.getLogger("ddpkit").warning(
                "ddpkit: the training set has %d samples, the checkpoint's run had %d; data.allow_length_change=true, "
                "so the epoch is re-planned for the new length from the same batch",
                self.length,
                saved_length,
            )


def take_batches(
    batches: Iterator[Any], count: int, *, progress: Progress, span: Callable[[str], AbstractContextManager[Any]]
) -> Iterator[Any]:
    """Up to ``count`` batches of this epoch, each read under the ``data`` span and counted as consumed
    (``progress.batch_in_epoch``) as it is handed over: what a step object iterates."""
    for _ in range(count):
        with span("data"):
            batch = next(batches, None)
        if batch is None:
            return
        progress.batch_in_epoch += 1
        yield batch
