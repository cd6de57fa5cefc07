"""The parallel layout's degrees, checked before any process group exists.

    problems = pipeline_problems(cfg)              # what no world size can fix (with cross_field_problems)
    problems += tensor_config_problems(cfg)        # the same for parallel.tensor
    problems += replicate_problems(cfg)            # and for parallel.replicate (HSDP)
    check_layout(cfg.parallel, world_size=8)       # ConfigError naming the valid layouts of 8 ranks

A layout is the degrees of the three ways of spreading a model: data parallel (dp, held by
``parallel.mode``), pipeline (pp, ``parallel.pipeline``) and tensor (tp, ``parallel.tensor``).
``dp = world_size / (pp * tp)``; under HSDP (``parallel.replicate: R``, fsdp2) dp is R replicas x dp / R shards,
R dividing dp. torchtitan checks the same arithmetic in its
``ParallelDims``; here it runs in the Trainer's constructor, from the environment the launcher set,
so a layout that cannot work stops with one message instead of a hang in the first send.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ddpkit.errors import ConfigError

if TYPE_CHECKING:
    from ddpkit.config.parallel import ParallelConfig
    from ddpkit.config.schema import Config

__all__ = [
    "pipeline_problems",
    "tensor_config_problems",
    "replicate_problems",
    "layout_problems",
    "check_layout",
    "microbatches_of",
    "default_microbatches",
    "with_microbatches",
    "mesh_coordinates",
    "rank_place",
    "INTERLEAVED",
]

#: Schedules that hold several stages on each rank (``parallel.stages_per_rank`` >= 2).
INTERLEAVED = ("interleaved_1f1b", "looped_bfs")


def mesh_coordinates(rank: int, *, world_size: int, pipeline: int, tensor: int = 1) -> tuple[int, int, int]:
    """``rank``'s ``(pp_rank, dp_rank, tp_rank)`` on the layout's ``("pp", "dp", "tp")`` mesh: row-major, as
    ``init_device_mesh`` numbers it, so a tensor group's ranks are neighbours and a stage's replicas follow."""
    replicas = world_size // (pipeline * tensor)
    stage, rest = divmod(rank, replicas * tensor)
    replica, tensor_rank = divmod(rest, tensor)
    return stage, replica, tensor_rank


def rank_place(*, pp_rank: int, dp_rank: int, tp_rank: int, pipeline: int, tensor: int) -> str:
    """A rank's place in words, as the log and the watchdog's reports say it: ``"stage 1 of replica 0, tensor
    rank 1"`` (the stage only under a pipeline, the tensor rank only with tensor parallelism)."""
    where = f"replica {dp_rank}"
    if pipeline > 1:
        where = f"stage {pp_rank} of {where}"
    if tensor > 1:
        where += f", tensor rank {tp_rank}"
    return where


def default_microbatches(stages: int) -> int:
    """M when ``parallel.microbatches`` is unset: twice the number of stages, at least 2 (a bubble of at most a
    third)."""
    return max(2, 2 * stages)


def microbatches_of(parallel: ParallelConfig) -> int:
    """M: ``parallel.microbatches``, or :func:`default_microbatches`."""
    if parallel.microbatches is not None:
        return parallel.microbatches
    return default_microbatches(parallel.pipeline)


def with_microbatches(cfg: Config, microbatches: int) -> Config:
    """``cfg`` as the data sees it under a pipeline: each replica's batch split into ``microbatches``, exactly as
    ``train.grad_accum_steps`` splits it (so a pipeline reads the samples an accumulating world of one reads)."""
    train = dataclasses.replace(cfg.train, grad_accum_steps=microbatches)
    return dataclasses.replace(cfg, train=train)


def pipeline_problems(cfg: Config) -> list[str]:
    """The pipeline options that cannot work whatever the world size, each naming the fix."""
    parallel = cfg.parallel
    problems = []
    if parallel.pipeline == 1:
        if parallel.microbatches is not None:
            problems.append(
                "parallel.microbatches: only with parallel.pipeline > 1; without a pipeline use train.grad_accum_steps"
            )
        return problems
    interleaved = parallel.schedule in INTERLEAVED
    if interleaved and parallel.stages_per_rank < 2:
        problems.append(
            f"parallel.stages_per_rank: schedule {parallel.schedule} holds several stages on each rank; set "
            "parallel.stages_per_rank=2 (or more), or parallel.schedule=1f1b"
        )
    if not interleaved and parallel.stages_per_rank != 1:
        problems.append(
            f"parallel.stages_per_rank: schedule {parallel.schedule} runs one stage on each rank; set "
            "parallel.stages_per_rank=1, or parallel.schedule=interleaved_1f1b"
        )
    if cfg.train.grad_accum_steps > 1:
        problems.append(
            "train.grad_accum_steps: a pipeline's microbatches are its accumulation; set train.grad_accum_steps=1 "
            f"and parallel.microbatches={cfg.train.grad_accum_steps}"
        )
    problems += _unsupported_with_a_pipeline(cfg)
    return problems


def _unsupported_with_a_pipeline(cfg: Config) -> list[str]:
    problems = []
    if cfg.train.precision == "fp16":
        problems.append(
            "train.precision: fp16's GradScaler would need one scale agreed across stages; use train.precision=bf16"
        )
    if cfg.ddp.comm_hook == "powersgd":
        problems.append("ddp.comm_hook: powersgd is not supported inside a pipeline; set ddp.comm_hook=none")
    # A rank holds one stage: no rank has the embedding, the blocks and the head that one generated token needs,
    # and generation through the stages (a send per token, the KV cache split by stage) is not written.
    if cfg.train.sample is not None:
        problems.append(
            "train.sample: generation needs the whole model on one rank and a pipeline rank holds one stage; set "
            "train.sample=null under parallel.pipeline > 1 and sample from model.pt"
        )
    return problems


def tensor_config_problems(cfg: Config) -> list[str]:
    """The ``parallel.tensor`` options that cannot work whatever the world size, each naming the fix.

    The model's own widths (heads, kv heads, MLP width divisible by T) are judged by the Trainer's constructor
    (:func:`ddpkit.parallel.parallelize.check_tensor_degree`), before any process group too.
    """
    parallel = cfg.parallel
    tensor = parallel.tensor
    if tensor == 1:
        problems = []
        if parallel.vocab_parallel:
            problems.append("parallel.vocab_parallel: only with parallel.tensor > 1; set parallel.vocab_parallel=false")
        if parallel.sequence_parallel:
            problems.append(
                "parallel.sequence_parallel: splits the sequence over the tensor ranks, only with parallel.tensor > 1; "
                "set parallel.sequence_parallel=false"
            )
        return problems
    problems = []
    if parallel.mode == "zero1":
        problems.append(
            "parallel.mode: zero1 does not shard tensor-parallel (DTensor) parameters; use parallel.mode=fsdp2 "
            "with parallel.tensor > 1 (it shards over the data-parallel ranks), or parallel.mode=ddp"
        )
    problems += _unsupported_with_tensor_parallel(cfg)
    return problems


def _unsupported_with_tensor_parallel(cfg: Config) -> list[str]:
    problems = []
    if cfg.train.sample is not None:
        problems.append(
            "train.sample: generation's KV cache holds the whole model's key/value heads, not a tensor rank's; set "
            "train.sample=null under parallel.tensor > 1 and sample from model.pt"
        )
    if cfg.train.precision == "fp16":
        problems.append(
            "train.precision: fp16's GradScaler is not run on tensor-parallel gradients; use train.precision=bf16"
        )
    if cfg.ddp.comm_hook != "none":
        problems.append(
            f"ddp.comm_hook: {cfg.ddp.comm_hook!r} is a DDP communication hook, and a tensor-parallel model is not "
            "wrapped in DDP; set ddp.comm_hook=none"
        )
    return problems


def replicate_problems(cfg: Config) -> list[str]:
    """The ``parallel.replicate`` options that cannot work whatever the world size, each naming the fix."""
    parallel = cfg.parallel
    if parallel.replicate == 1 or parallel.mode == "fsdp2":
        return []
    return [
        f"parallel.replicate: {parallel.replicate} replicas of fsdp2's shards (HSDP) need parallel.mode=fsdp2, got "
        f"{parallel.mode} (which already holds a whole copy on every data-parallel rank); set parallel.mode=fsdp2 or "
        "parallel.replicate=1"
    ]


def _replicate_divides(parallel: ParallelConfig, *, world_size: int) -> list[str]:
    """R must divide the data-parallel degree, so that every replica holds the same number of shards."""
    replicate = parallel.replicate
    replicas = world_size // (parallel.pipeline * parallel.tensor)
    if replicate == 1 or replicas % replicate == 0:
        return []
    valid = [str(r) for r in range(1, replicas + 1) if replicas % r == 0]
    return [
        f"parallel.replicate: {replicate} does not divide the data-parallel degree {replicas} (world size "
        f"{world_size} / (pipeline {parallel.pipeline} x tensor {parallel.tensor})); valid: {', '.join(valid)}"
    ]


def layout_problems(parallel: ParallelConfig, *, world_size: int) -> list[str]:
    """What this layout cannot do on ``world_size`` ranks (P x T not dividing it, too few microbatches)."""
    stages = parallel.pipeline
    tensor = parallel.tensor
    if stages == 1 and tensor == 1:
        return _replicate_divides(parallel, world_size=world_size)
    if world_size % (stages * tensor):
        if tensor == 1:
            degrees = f"parallel.pipeline: {stages} stages do not"
        elif stages == 1:
            degrees = f"parallel.tensor: {tensor} does not"
        else:
            degrees = f"parallel.pipeline x parallel.tensor: {stages} x {tensor} does not"
        return [
            f"{degrees} divide the world size {world_size}; valid on {world_size} ranks: {_valid_layouts(world_size)}"
        ]
    problems = _replicate_divides(parallel, world_size=world_size)
    replicas = world_size // (stages * tensor)
    if tensor > 1 and replicas > 1 and parallel.mode == "ddp":
        problems.append(
            f"parallel.mode: ddp cannot replicate a tensor-parallel model over {replicas} data-parallel ranks (torch's "
            "DDP takes DTensor parameters only through a private transform that checkpoints cannot read); use "
            f"parallel.mode=fsdp2 (it shards over the {replicas} replicas), or "
            f"parallel.tensor={world_size // stages} (one replica)"
        )
    if stages == 1:
        return problems
    microbatches = microbatches_of(parallel)
    if parallel.schedule != "gpipe" and microbatches < stages:
        problems.append(
            f"parallel.microbatches: {parallel.schedule} needs at least as many microbatches as stages ({stages}), "
            f"got {microbatches}; set parallel.microbatches={2 * stages} (or parallel.schedule=gpipe)"
        )
    if parallel.schedule in INTERLEAVED and microbatches % stages:
        problems.append(
            f"parallel.microbatches: {parallel.schedule} runs microbatches in rounds of {stages}; "
            f"set a multiple of {stages} (got {microbatches})"
        )
    return problems


def check_layout(parallel: ParallelConfig, *, world_size: int) -> None:
    """Raise ConfigError with every problem of this layout on ``world_size`` ranks (see :func:`layout_problems`)."""
    problems = layout_problems(parallel, world_size=world_size)
    if problems:
        raise ConfigError("the parallel layout cannot run:\n  " + "\n  ".join(problems))


def _valid_layouts(world_size: int) -> str:
    """Every (pipeline, tensor) pair that divides ``world_size``, with the data-parallel degree it leaves."""
    degrees = [d for d in range(1, world_size + 1) if world_size % d == 0]
    choices = [(p, t) for p in degrees for t in degrees if world_size % (p * t) == 0]
    return ", ".join(
        f"pipeline={p} tensor={t} (data-parallel {world_size // (p * t)})"
        if t > 1
        else f"pipeline={p} (data-parallel {world_size // p})"
        for p, t in choices
    )
