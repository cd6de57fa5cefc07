"""Checks that two things which must agree do: every rank at startup, and a checkpoint with the run resuming it.

Before the first step, ranks exchange a fingerprint (config hash, model parameter count and
shapes, dataset lengths, ddpkit and torch versions). A rank that got a different override, a
different file, a different data directory or a different install would otherwise train
silently wrong or hang at the first allreduce; here every rank stops with a message naming the
field and each rank's value.

:func:`config_differences` compares a checkpoint's config with the resuming run's: fields that
change the math (model, data order and batches, optimizer, schedule, precision, seed, world size)
must match; fields that only change bookkeeping (:data:`HARMLESS_PREFIXES`) may differ. The layout and the split
of the global batch (per-rank batch, accumulation, a pipeline's microbatches: :data:`SPLIT_KEYS`) may change as long
as the global batch stays: the data position is kept in samples (:mod:`ddpkit.data.position`).
"""

from __future__ import annotations

import math
from collections.abc import Sized
from typing import Any

import torch

from ddpkit._version import __version__
from ddpkit.config.schema import Config
from ddpkit.config.serialize import config_to_dict, flatten
from ddpkit.config.split import Split
from ddpkit.distributed.collectives import all_gather_object
from ddpkit.distributed.ddp import parameter_shapes
from ddpkit.errors import ConsistencyError

__all__ = ["check_ranks_agree", "check_same_run_on_every_rank", "config_differences", "HARMLESS_PREFIXES", "SPLIT_KEYS"]

#: Config paths (and path prefixes) that may differ between a checkpoint and the resuming run.
HARMLESS_PREFIXES = (
    "run.name",
    "run.output_dir",
    "dist.",
    "log.",
    "checkpoint.",
    "train.epochs",
    "train.max_steps",
    "train.log_every",
    "train.eval_every",
    "train.timeline",
    "train.early_stopping.",
    "data.num_workers",
    "data.val_batch_size",
    "data.pin_memory",
    "data.persistent_workers",
    "data.prefetch_factor",
    # A stream's read-ahead: the batches trained and the epoch's end do not depend on it.
    "data.stream_window",
    # A permission for this resume (checked by the data order), not part of the math.
    "data.allow_length_change",
    "train.compile",
    "train.channels_last",
    # How fast, not what is computed.
    "train.keep_host_memory",
    # A check before the model is made, not part of the math.
    "train.memory_check",
    # Which kernels compute it: the same math, in a fixed order.
    "train.deterministic",
    # Where the gradients live, not their values (the same buckets are all-reduced).
    "ddp.gradient_as_bucket_view",
    # What to do about a bad step; the steps that are not bad compute the same.
    "health.",
    # Where the shards live; sharded checkpoints load into any mode (ddpkit.checkpoint.sharded).
    "parallel.",
)


#: The keys that split the global batch: they may change while the global batch stays (:func:`config_differences`).
SPLIT_KEYS = ("data.batch_size", "train.grad_accum_steps", "parallel.microbatches")


def check_same_run_on_every_rank(config: Config, model: torch.nn.Module, train_set: Any, val_set: Any) -> None:
    """Stop every rank with the differences if ranks built different configs, models or datasets."""
    shapes = parameter_shapes(model)
    check_ranks_agree(
        {
            "config": flatten(config_to_dict(config)),
            "parameter_count": sum(math.prod(shape) for _, shape in shapes),
            "parameter_shapes": shapes,
            # A stream has no length.
            "train_dataset_length": len(train_set) if isinstance(train_set, Sized) else None,
            "val_dataset_length": len(val_set) if isinstance(val_set, Sized) else None,
            "ddpkit_version": __version__,
            "torch_version": str(torch.__version__),
        }
    )


def check_ranks_agree(fingerprint: dict[str, Any]) -> None:
    """Compare ``fingerprint`` across ranks (a collective); raise ConsistencyError on any difference."""
    everyone = all_gather_object(fingerprint)
    problems = [describe_difference(key, [fp.get(key) for fp in everyone]) for key in fingerprint]
    problems = [p for p in problems if p]
    if problems:
        raise ConsistencyError(
            "ranks disagree on what must be identical on every rank:\n"
            + "\n".join(f"  - {p}" for p in problems)
            + "\nEvery rank must get the same config file, overrides, data and software versions."
        )


def describe_difference(key: str, values: list[Any]) -> str | None:
    """``None`` if all ``values`` are equal, else one line naming ``key`` and each rank's value."""
    if all(v == values[0] for v in values):
        return None
    if all(isinstance(v, dict) for v in values):
        # Flattened configs: name each key whose value differs.
        keys = sorted(set().union(*values))
        lines = [describe_difference(f"{key}.{sub}", [v.get(sub, "<unset>") for v in values]) for sub in keys]
        return "\n  - ".join(line for line in lines if line)
    if all(isinstance(v, list) for v in values):
        # Long lists (parameter shapes): show the first entry where ranks differ.
        width = max(len(v) for v in values)
        for index in range(width):
            entries = [v[index] if index < len(v) else "<missing>" for v in values]
            if any(e != entries[0] for e in entries):
                shown = ", ".join(f"rank {r}: {e!r}" for r, e in enumerate(entries))
                return f"{key}[{index}] differs: {shown}"
    shown = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
    return f"{key} differs: {shown}"


def config_differences(
    saved: dict[str, Any], current: dict[str, Any], *, saved_world_size: int, world_size: int, elastic: bool = False
) -> list[str]:
    """Human-readable differences in math-changing fields, e.g. ``"optim.lr: 0.1 -> 0.2"``.

    The layout (``parallel.*``) and the split of the global batch (:data:`SPLIT_KEYS`) may change: the global
    batch (samples per optimizer step) may not. ``elastic`` (``data.global_batch_size`` is set): the number of
    data-parallel replicas may change too; without it each replica's share of the order depends on their number
    (then the samples per step are ``data.batch_size x accumulation x replicas``). A field the saved config
    lacks was added to ddpkit after the checkpoint was written; it counts as its default, which a new field keeps at
    the earlier behaviour, so checkpoints of earlier releases resume.
    """
    defaults = flatten(config_to_dict(Config()))
    old, new = flatten(saved), flatten(current)
    saved_split, split = Split.of(old, world_size=saved_world_size), Split.of(new, world_size=world_size)
    # Another split of the same global batch trains on the same samples (ddpkit.data.position): not a difference.
    same_batch = saved_split.samples_per_step == split.samples_per_step
    differences = []
    for path in sorted(old.keys() | new.keys()):
        if path.startswith(HARMLESS_PREFIXES) or (same_batch and path in SPLIT_KEYS):
            continue
        before = old.get(path, defaults.get(path, "<unset>"))
        after = new.get(path, "<unset>")
        if before != after:
            differences.append(f"{path}: {before!r} -> {after!r}")
    if not same_batch and new.get("data.global_batch_size") is None:
        differences.append(
            f"samples per optimizer step: {saved_split.samples_per_step} -> {split.samples_per_step} "
            "(data.batch_size x train.grad_accum_steps or parallel.microbatches x data-parallel replicas)"
        )
    if saved_split.replicas != split.replicas and not elastic:
        what = f"data-parallel replicas: {saved_split.replicas} -> {split.replicas}"
        if saved_world_size != world_size:
            what = f"world size: {saved_world_size} -> {world_size} ({what})"
        differences.append(
            f"{what}: the sample order depends on them unless the run sets data.global_batch_size; train with it to "
            "resume on another number of processes or another layout"
        )
    return differences
