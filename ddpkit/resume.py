"""Deciding whether a checkpoint may be resumed by the current config.

Fields that change the math (model, data order and batches, optimizer, schedule, precision,
seed, world size) must match, or the resumed run would silently differ from the run it
continues. Fields that only change bookkeeping (logging, how long to train, where to write,
checkpoint cadence, timeouts) may differ.
"""

from __future__ import annotations

from typing import Any

from ddpkit.config_loader import flatten

__all__ = ["HARMLESS_PREFIXES", "config_differences"]

#: Config paths (and path prefixes) that may differ between a checkpoint and the resuming run.
HARMLESS_PREFIXES = (
    "run.name", "run.output_dir", "dist.", "log.", "checkpoint.", "train.epochs", "train.max_steps",
    "train.log_every", "train.eval_every", "train.timeline", "train.early_stopping.", "data.num_workers",
    "data.val_batch_size", "data.pin_memory",
)


def config_differences(saved: dict[str, Any], current: dict[str, Any], *, saved_world_size: int, world_size: int) -> list[str]:
    """Human-readable differences in math-changing fields, e.g. ``"optim.lr: 0.1 -> 0.2"``."""
    old, new = flatten(saved), flatten(current)
    differences = []
    for path in sorted(old.keys() | new.keys()):
        if path.startswith(HARMLESS_PREFIXES):
            continue
        before, after = old.get(path, "<unset>"), new.get(path, "<unset>")
        if before != after:
            differences.append(f"{path}: {before!r} -> {after!r}")
    if saved_world_size != world_size:
        differences.append(f"world size: {saved_world_size} -> {world_size}")
    return differences
