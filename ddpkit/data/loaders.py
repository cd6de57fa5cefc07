"""Data loaders for DDP: sharded training order, exact evaluation, resumable epochs, seeded workers.

Training (``build_train_loader``): a ``DistributedSampler`` gives each rank a disjoint slice of a
permutation that depends only on ``(seed, epoch)``; ``start_epoch`` must be called before every
epoch (the Trainer does it), optionally starting part-way through for an exact mid-epoch resume.

Evaluation (``build_eval_loader``): rank ``r`` of ``W`` sees samples ``r, r+W, r+2W, ...`` and
nothing else. ``DistributedSampler`` would pad the last shard with duplicates so every rank has
the same count, which skews metrics; here shards differ by at most one sample and every sample
is counted exactly once, whatever the world size.

Randomness: each loader owns a ``torch.Generator`` reseeded per epoch, so iterating a loader never
consumes the global RNG (which would make a resumed run diverge). With ``num_workers > 0`` every
sample's random augmentation is seeded from ``(seed, epoch, index)``, so it is the same whatever
the number of workers and after a resume.
"""

from __future__ import annotations

import itertools
import math
import random
import sys
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, get_worker_info

from ddpkit.data.elastic import GlobalBatchSampler, per_rank_batch_size
from ddpkit.data.streaming import UNKNOWN_LENGTH, build_stream_eval_loader, build_stream_loader, is_stream, stream_epochs_of, stream_total_steps
from ddpkit.distributed.env import DistEnv
from ddpkit.distributed.process_group import all_gather_object
from ddpkit.errors import DataError, DdpkitError

__all__ = [
    "ResumableDistributedSampler",
    "ExactShardSampler",
    "build_train_loader",
    "build_eval_loader",
    "start_epoch",
    "move_to_device",
    "batch_size_of",
    "agree_on_batch_count",
    "exact_batches",
    "train_loader_for",
    "val_loader_for",
]


class ResumableDistributedSampler(DistributedSampler):
    """A ``DistributedSampler`` whose epoch can start at any sample position (for mid-epoch resume)."""

    start_index = 0
    #: Yield ``(epoch, index)`` pairs: persistent worker processes keep their own copy of the
    #: dataset, so the epoch a sample is seeded with has to travel with its index.
    tag_epoch = False

    def set_epoch(self, epoch: int, start_index: int = 0) -> None:
        super().set_epoch(epoch)
        self.start_index = start_index

    def __iter__(self) -> Iterator[Any]:
        indices = super().__iter__()
        if self.start_index:
            indices = itertools.islice(indices, self.start_index, None)
        return zip(itertools.repeat(self.epoch), indices) if self.tag_epoch else indices

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


class _SampleSeeded(Dataset):
    """Seeds the worker's RNGs from ``(seed, epoch, index)`` before loading each sample."""

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset, self.seed, self.epoch = dataset, seed, 0

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: int | tuple[int, int]) -> Any:
        epoch, index = key if isinstance(key, tuple) else (self.epoch, key)
        if get_worker_info() is not None:  # only inside worker processes: never touch the main RNG
            sample_seed = hash((self.seed, epoch, index)) & 0xFFFF_FFFF
            # The CPU generator only: what torch.manual_seed sets for the CPU, without also seeding
            # every accelerator backend, which costs up to milliseconds per call (per sample here).
            torch.default_generator.manual_seed(sample_seed)
            random.seed(sample_seed)
            if "numpy" in sys.modules:
                sys.modules["numpy"].random.seed(sample_seed)
        return self.dataset[index]


def build_train_loader(
    dataset: Dataset, *, env: DistEnv, batch_size: int, num_workers: int = 0, shuffle: bool = True,
    drop_last: bool = True, seed: int = 0, pin_memory: bool = False, persistent_workers: bool = True,
    prefetch_factor: int | None = None, global_batch_size: int | None = None, grad_accum_steps: int = 1,
) -> DataLoader:
    """A training loader whose sampler shards ``dataset`` over ``env.world_size`` ranks.

    With ``global_batch_size`` the order is the same at any world size (see :mod:`ddpkit.data.elastic`)
    and ``batch_size`` must be this rank's share of it.

    With ``num_workers > 0`` the workers persist across epochs (``persistent_workers``): no
    restart cost per epoch, and the per-sample seeds still follow ``(seed, epoch, index)``.

    Raises:
        DataError: the dataset is empty, or too small to give every rank one full batch.
    """
    if is_stream(dataset):  # an IterableDataset: sharded, batched and made resumable by ddpkit.data.streaming
        return build_stream_loader(
            dataset, env=env, batch_size=batch_size, num_workers=num_workers, pin_memory=pin_memory, seed=seed, prefetch_factor=prefetch_factor,
        )
    length = _length(dataset, "training")
    if drop_last and length < env.world_size * batch_size:
        raise DataError(
            f"the training set has {length} samples, fewer than world_size ({env.world_size}) x data.batch_size "
            f"({batch_size}) = {env.world_size * batch_size}, so with data.drop_last=true no rank gets a full batch. "
            "Use a smaller data.batch_size, fewer processes, or data.drop_last=false."
        )
    if global_batch_size is not None:
        sampler: ResumableDistributedSampler | GlobalBatchSampler = GlobalBatchSampler(
            dataset, global_batch_size=global_batch_size, rank=env.rank, world_size=env.world_size,
            grad_accum_steps=grad_accum_steps, shuffle=shuffle, seed=seed,
        )
    else:
        sampler = ResumableDistributedSampler(dataset, num_replicas=env.world_size, rank=env.rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
    source = _SampleSeeded(dataset, seed) if num_workers else dataset
    sampler.tag_epoch = bool(num_workers)
    return DataLoader(
        source, batch_size=batch_size, sampler=sampler, num_workers=num_workers, drop_last=drop_last,
        pin_memory=pin_memory, generator=torch.Generator(), **_worker_options(num_workers, persistent_workers, prefetch_factor),
    )


def build_eval_loader(
    dataset: Dataset, *, env: DistEnv, batch_size: int, num_workers: int = 0, pin_memory: bool = False,
    persistent_workers: bool = True, prefetch_factor: int | None = None,
) -> DataLoader:
    """An evaluation loader over this rank's exact shard (possibly empty when the set is tiny)."""
    if is_stream(dataset):
        return build_stream_eval_loader(dataset, env=env, batch_size=batch_size, num_workers=num_workers, pin_memory=pin_memory)
    sampler = ExactShardSampler(_length(dataset, "validation"), rank=env.rank, world_size=env.world_size)
    return DataLoader(
        dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers, pin_memory=pin_memory,
        generator=torch.Generator().manual_seed(0), **_worker_options(num_workers, persistent_workers, prefetch_factor),
    )


def _worker_options(num_workers: int, persistent: bool, prefetch_factor: int | None) -> dict[str, Any]:
    """DataLoader's worker arguments; torch rejects both without worker processes."""
    if not num_workers:
        return {}
    return {"persistent_workers": persistent, **({"prefetch_factor": prefetch_factor} if prefetch_factor else {})}


def start_epoch(loader: DataLoader, epoch: int, *, start_batch: int = 0) -> None:
    """Prepare ``loader`` for ``epoch``, skipping the first ``start_batch`` batches (resume)."""
    if (stream := stream_epochs_of(loader)) is not None:
        return stream.start_epoch(epoch, start_batch=start_batch)
    sampler = loader.sampler
    if isinstance(sampler, (ResumableDistributedSampler, GlobalBatchSampler)):
        sampler.set_epoch(epoch, start_batch * (loader.batch_size or 1))
    elif isinstance(sampler, DistributedSampler) or hasattr(sampler, "set_epoch"):
        if start_batch:
            raise DataError(
                f"cannot resume mid-epoch with a {type(sampler).__name__}: it cannot skip samples. "
                "Use ddpkit.data.loaders.ResumableDistributedSampler or checkpoint only at epoch ends."
            )
        sampler.set_epoch(epoch)  # type: ignore[union-attr]
    if isinstance(loader.dataset, _SampleSeeded):
        loader.dataset.epoch = epoch
    if loader.generator is not None:
        seed = loader.sampler.seed if isinstance(loader.sampler, DistributedSampler) else 0
        loader.generator.manual_seed(seed * 1_000_003 + epoch)


def move_to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor moved to ``device`` (tuples, lists and dicts are walked)."""
    if isinstance(batch, torch.Tensor):
        return batch if batch.device == device else batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to_device(item, device) for item in batch)
    if isinstance(batch, dict):
        return {key: move_to_device(value, device) for key, value in batch.items()}
    return batch


def batch_size_of(batch: Any) -> int:
    """The number of samples in ``batch``: the length of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return len(batch)
    if isinstance(batch, (list, tuple)) and batch:
        return batch_size_of(batch[0])
    if isinstance(batch, dict) and batch:
        return batch_size_of(next(iter(batch.values())))
    raise DdpkitError(f"cannot tell the batch size of a {type(batch).__name__}; return per-sample (1-D) metrics from validation_step")


def _length(dataset: Dataset, what: str) -> int:
    if not isinstance(dataset, Sized):
        raise DataError(f"the {what} dataset {type(dataset).__name__} has no len(); return a map-style Dataset or a torch.utils.data.IterableDataset")
    length = len(dataset)
    if length == 0:
        raise DataError(f"the {what} dataset is empty; check data.name and data.kwargs (e.g. the root path)")
    return length


def agree_on_batch_count(loader: DataLoader, *, epoch: int, consumed: int) -> int:
    """This epoch's batch count (``consumed`` already done plus what ``loader`` yields), the same on every rank.

    DDP needs every rank to run the same number of backward passes: a rank with an extra
    batch would wait forever in an allreduce the others never join. A custom sampler that
    shards unevenly is stopped here, on every rank, with the counts. A stream's count is not known
    ahead (UNKNOWN_LENGTH): its ranks agree as they read, and its batches end on every rank at once.
    """
    if stream_epochs_of(loader) is not None:
        return UNKNOWN_LENGTH
    counts = all_gather_object(consumed + len(loader))
    if any(count != counts[0] for count in counts):
        raise DataError(
            f"ranks would run different numbers of training batches in epoch {epoch}: "
            + ", ".join(f"rank {rank}: {count}" for rank, count in enumerate(counts))
            + ". DDP needs the same number on every rank (a rank with more would wait forever in allreduce). "
            "Give every rank the same number of samples, e.g. DistributedSampler(drop_last=True) and data.drop_last=true."
        )
    if counts[0] == 0:
        raise DataError(f"the training loader yields no batches on any rank in epoch {epoch}; check the dataset and data.batch_size")
    return counts[0]


def exact_batches(loader: DataLoader, *, count: int, rank: int, epoch: int, consumed: int) -> Iterator[Any]:
    """The next ``count - consumed`` batches of ``loader``; a DataError if it ends before its len() promised.

    A stream's batches simply end, at the same batch on every rank (ddpkit.data.streaming).
    """
    if (stream := stream_epochs_of(loader)) is not None:
        yield from stream
        return
    batches = iter(loader)
    for position in range(consumed, count):
        batch = next(batches, None)
        if batch is None:
            raise DataError(
                f"rank {rank}'s training loader ended after {position} batches of epoch {epoch}, "
                f"but its len() promised {count}; fix the sampler's __len__"
            )
        yield batch


def run_length(loader: DataLoader, config: Any) -> tuple[int, int]:
    """``(steps_per_epoch, total_steps)`` of a training run; UNKNOWN_LENGTH where a stream does not say."""
    train = config.train
    if stream_epochs_of(loader) is not None:
        total = stream_total_steps(max_steps=train.max_steps, epochs=train.epochs, steps_per_epoch=None, sched_name=config.sched.name)
        return UNKNOWN_LENGTH, total or UNKNOWN_LENGTH
    steps_per_epoch = math.ceil(len(loader) / train.grad_accum_steps)
    return steps_per_epoch, int(min(train.max_steps or math.inf, (train.epochs or math.inf) * steps_per_epoch))


def train_loader_for(dataset: Dataset, config: Any, *, env: DistEnv, device: torch.device) -> DataLoader:
    """The Trainer's default training loader: :func:`build_train_loader` with the config's ``data`` options."""
    cfg, accum = config.data, config.train.grad_accum_steps
    loader = build_train_loader(
        dataset, env=env, batch_size=per_rank_batch_size(cfg, world_size=env.world_size, grad_accum_steps=accum),
        num_workers=cfg.num_workers, shuffle=cfg.shuffle, drop_last=cfg.drop_last, seed=config.run.seed,
        pin_memory=cfg.pin_memory and device.type == "cuda", persistent_workers=cfg.persistent_workers,
        prefetch_factor=cfg.prefetch_factor, global_batch_size=cfg.global_batch_size, grad_accum_steps=accum,
    )
    if (stream := stream_epochs_of(loader)) is not None:  # reads ahead, and stops, in whole optimizer steps
        stream.accum, stream.window_steps = config.train.grad_accum_steps, cfg.stream_window
    return loader


def data_position(loader: DataLoader) -> dict[str, Any]:
    """Checkpoint components for where the loader is: a stream's window state; nothing for a sampler
    (the Trainer's ``Progress.batch_in_epoch`` is all a map-style loader needs)."""
    stream = stream_epochs_of(loader)
    return {"data_position": stream} if stream is not None else {}


def val_loader_for(dataset: Dataset, config: Any, *, env: DistEnv, device: torch.device) -> DataLoader:
    """The Trainer's default validation loader: :func:`build_eval_loader` with the config's ``data`` options."""
    cfg = config.data
    per_rank = per_rank_batch_size(cfg, world_size=env.world_size, grad_accum_steps=config.train.grad_accum_steps)
    return build_eval_loader(
        dataset, env=env, batch_size=cfg.val_batch_size or per_rank, num_workers=cfg.num_workers,
        pin_memory=cfg.pin_memory and device.type == "cuda", persistent_workers=cfg.persistent_workers,
        prefetch_factor=cfg.prefetch_factor,
    )
