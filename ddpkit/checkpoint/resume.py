"""Which checkpoint a run resumes from, and whether it may: chosen once by rank 0, checked on every rank.

    chosen = choose_checkpoint(config, rank=rank)          # (path, state) or None; a collective (one broadcast)
    check_compatible(state, path, config, world_size=2, components=components)   # or a CheckpointError

Choosing the file: rank 0 alone resolves ``checkpoint.resume`` (so every rank agrees even if a save
lands meanwhile; a newer in-memory snapshot wins, :mod:`ddpkit.checkpoint.memory_tier`) and broadcasts
the path; every rank then reads that file, which must be on a filesystem all nodes share.

Compatibility: fields that change the math (model, data order and batches, optimizer, schedule,
precision, seed, world size) must match, or the resumed run would silently differ from the run it
continues. Fields that only change bookkeeping (logging, how long to train, where to write,
checkpoint cadence, timeouts) may differ. The world size may differ when ``data.global_batch_size``
is set: the sample order then does not depend on it (:mod:`ddpkit.data.elastic`).
"""

from __future__ import annotations

from typing import Any

from ddpkit.checkpoint import files as ckpt
from ddpkit.checkpoint.components import Components, read_checkpoint
from ddpkit.checkpoint.memory_tier import prefer_newer
from ddpkit.checkpoint.sharded_run import read_any
from ddpkit.config.schema import Config
from ddpkit.config.serialize import config_to_dict, flatten
from ddpkit.config.split import Split
from ddpkit.data.position import upgraded
from ddpkit.distributed.agreement import config_differences
from ddpkit.distributed.collectives import broadcast_object
from ddpkit.errors import CheckpointError
from ddpkit.progress import Progress
from ddpkit.reporting.log import log

__all__ = ["choose_checkpoint", "check_compatible", "with_sample_position", "saved_split", "note_allowed_position"]


def choose_checkpoint(config: Config, *, rank: int) -> tuple[str, dict[str, Any]] | None:
    """The checkpoint ``checkpoint.resume`` names, read on every rank, or None for a fresh start (a collective)."""
    choice = problem = None
    if rank == 0:
        try:
            info = prefer_newer(ckpt.resolve_resume_path(config.checkpoint.resume, config.checkpoint_dir), config)
            choice = str(info.path) if info else None
        except CheckpointError as exc:
            problem = str(exc)
    choice, problem = broadcast_object((choice, problem))
    if problem is not None:
        raise CheckpointError(problem)
    if choice is None:
        return None
    # A file, or a sharded checkpoint's state.pt.
    return choice, read_checkpoint(read_any(choice), path=choice)


def check_compatible(
    state: dict[str, Any], path: str, config: Config, *, world_size: int, components: Components
) -> list[str]:
    """Refuse a checkpoint whose run differs in fields that change the math (unless allowed), naming each field.

    Returns the differences ``checkpoint.allow_config_change`` let through (empty: the same math, perhaps another
    layout or split of the same global batch, which one line names)."""
    elastic = config.data.global_batch_size is not None
    saved_world_size = state["world_size"]
    # How the checkpoint's run and this one split the global batch.
    before, split = saved_split(state), Split.of_config(config, world_size=world_size)
    differences = config_differences(
        state["config"],
        config_to_dict(config),
        saved_world_size=saved_world_size,
        world_size=world_size,
        elastic=elastic,
    )
    if elastic and saved_world_size != world_size and not differences:
        log.info(
            "resuming on %d rank(s) a run checkpointed on %d: same samples per step (data.global_batch_size=%d); "
            "each rank continues rank 0's random streams",
            world_size,
            saved_world_size,
            config.data.global_batch_size,
        )
    differences += _legacy_order_difference(state["config"], components)
    differences += _stream_split_difference(before, split, components)
    if differences and not config.checkpoint.allow_config_change:
        raise CheckpointError(
            f"cannot resume from {path}: it was written by a run whose config differs in fields that change the math:\n"
            + "\n".join(f"  - {d}" for d in differences)
            + "\nStart fresh with checkpoint.resume=none (or a new run.output_dir), "
            "or resume anyway with checkpoint.allow_config_change=true."
        )
    if not differences:
        _note_split(before, split, config)
    return differences


def saved_split(state: dict[str, Any]) -> Split:
    """How the checkpoint's run split its global batch (from the config and world size it saved)."""
    return Split.of(flatten(state["config"]), world_size=state["world_size"])


def with_sample_position(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` whose ``progress`` holds the epoch's position in samples (``sample_in_epoch``): a checkpoint from
    before it existed is converted with its own run's split (ddpkit.data.position)."""
    return {**state, "progress": upgraded(state["progress"], saved_split(state))}


def _note_split(saved: Split, split: Split, config: Config) -> None:
    """One line when the same global batch is split another way: the same samples; whether the same arithmetic."""
    if saved == split:
        return
    change = f"{saved.describe()} -> {split.describe()}, {split.samples_per_step} samples a step"
    pieces = (saved.replicas * saved.batches_per_step, split.replicas * split.batches_per_step)
    if pieces[0] == pieces[1]:
        log.info("resuming with another layout (%s): the same samples and the same microbatches", change)
    elif config.train.loss_normalization == "tokens":
        log.info("resuming with another split (%s): the same samples; loss_normalization: tokens sums alike", change)
    else:
        log.warning(
            "resuming with another split (%s): the same samples, but under train.loss_normalization: mean each of "
            "the %d microbatches' means now counts equally (%d before), which differs wherever they hold unequal "
            "numbers of loss terms (ignored targets); loss_normalization: tokens is the same under any split",
            change,
            pieces[1],
            pieces[0],
        )


def note_allowed_position(differences: list[str], progress: Progress, split: Split) -> None:
    """After a resume that ``checkpoint.allow_config_change`` let through: which samples the run goes on with."""
    if not differences:
        return
    first = progress.batch_in_epoch * split.samples_per_batch
    log.warning(
        "resumed despite %d difference(s) (checkpoint.allow_config_change=true): from step %d the run goes on with "
        "samples %d.. of epoch %d's order, %d a step",
        len(differences),
        progress.step + 1,
        first,
        progress.epoch,
        split.samples_per_step,
    )


def _stream_split_difference(saved: Split, split: Split, components: Components) -> list[str]:
    """A stream keeps its position in its own loader's batches (ddpkit.data.stream_epochs), which another split
    of the same global batch does not find: its split must stay."""
    if "data_position" not in components.names or saved == split:
        return []
    return [
        f"the split of the global batch: {saved.describe()} -> {split.describe()} (a stream resumes only in the "
        "split it was checkpointed in: its position is kept in its loader's batches)"
    ]


def _legacy_order_difference(saved: dict[str, Any], components: Components) -> list[str]:
    """A checkpoint from before ``data.order`` existed drew its samples by ``randperm``; ``auto`` may now mean
    another order."""
    current = getattr(components["data_order"], "resolved", None) if "data_order" in components.names else None
    if "order" in saved.get("data", {}) or current in (None, "randperm", "sequential"):
        return []
    return [
        "data.order: the checkpoint predates it and used 'randperm'; "
        f"this run would use {current!r} (set data.order=randperm)"
    ]
