"""A pipeline's placement: the model cut into stages, this rank's kept and wrapped, torch's stages and schedule.

    pipeline = build_pipeline(model, layout, cfg, runtime, split=trainer.pipeline_stages, loss=trainer.pipeline_loss)
    pipeline.held          # the parts this rank holds, under the whole model's names (what it saves and trains)
    pipeline.schedule      # torch's schedule, which ddpkit.training.pipeline_step runs each optimizer step

Everything that moves activations or gradients between stages is torch's own
(``torch.distributed.pipelining``: ``PipelineStage``, ``ScheduleGPipe``, ``Schedule1F1B``,
``ScheduleInterleaved1F1B``, ``ScheduleLoopedBFS``); ddpkit cuts the model (:mod:`ddpkit.parallel.pipeline_split`),
and feeds the schedule the microbatches the data-parallel accumulation would have used.

Data parallelism inside: each stage goes through the layout's way of holding parameters
(:mod:`ddpkit.parallel.data_parallel`): DDP over the data-parallel group (``ddp``, ``zero1``), or its blocks and itself
``fully_shard``-ed over the layout's ``dp`` mesh dimension (``fsdp2``); torch's stage runs ``no_sync`` (DDP) or turns
gradient sync off (FSDP2) for all microbatches but the last itself.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.config.layout import INTERLEAVED, microbatches_of
from ddpkit.config.schema import Config
from ddpkit.distributed import ddp as ddp_wrap
from ddpkit.distributed.process_group import Runtime
from ddpkit.errors import ConfigError
from ddpkit.models.init_by_name import is_on_meta
from ddpkit.models.lora import adapter_only_parts
from ddpkit.parallel.layout import ParallelLayout
from ddpkit.parallel.pipeline_forward import PipelineForward
from ddpkit.parallel.pipeline_split import HeldParts, TiedWeights, split_model, stage_blocks, tied_weight
from ddpkit.reporting.log import log

__all__ = ["Pipeline", "build_pipeline", "StageClock", "bubble_fraction"]

_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "looped_bfs": "ScheduleLoopedBFS",
}


def bubble_fraction(stages: int, microbatches: int) -> float:
    """The idle share of a GPipe / 1F1B step in theory: (P - 1) / (M + P - 1)."""
    return (stages - 1) / (microbatches + stages - 1)


@dataclass
class Pipeline:
    """This rank's part of the pipeline: its stage modules, what they hold, torch's stages and schedule."""

    stages: list[nn.Module]
    held: nn.Module
    wrapped: list[nn.Module]
    schedule: Any
    microbatches: int
    first: bool
    last: bool
    tied: TiedWeights
    #: The parameters whose gradients count in the norm: the tied matrix once (on the first stage).
    norm_parameters: list[torch.Tensor]
    #: Validation's forward through the stages (the held parts' forward on the last stage).
    forward: PipelineForward
    #: This rank's compute inside the schedule, timed (ddpkit.reporting.stage_time reports it).
    clock: StageClock
    #: This rank's coordinate in the pipeline (its first stage under an interleaved schedule), and the theory's
    #: bubble (P - 1) / (M + P - 1) (None for the interleaved schedules).
    stage: int
    theory: float | None
    #: Whether every stage's forward takes the microbatch's token ids (``tokens=``): the document mask
    #: (``data.kwargs.document_mask``) is found in them on each stage, as the whole model finds it in its input.
    takes_tokens: bool = False


def build_pipeline(
    model: nn.Module,
    layout: ParallelLayout,
    config: Config,
    runtime: Runtime,
    *,
    split: Callable[[nn.Module, int], list[nn.Module] | None] | None,
    loss: Callable[[torch.Tensor, Any], torch.Tensor] | None,
    prepare: Callable[[nn.Module], nn.Module] = lambda stage: stage,
    made: Callable[[nn.Module], nn.Module] = lambda stage: stage,
) -> Pipeline:
    """Cut ``model`` (built whole, the same on every rank), keep this rank's stages, wrap and schedule them.

    ``split(model, stages)``: the Trainer's ``pipeline_stages`` (None, or returning None: ddpkit's own cut);
    ``loss(output, target)``: the last stage's loss per microbatch; ``prepare(stage)``: what each local stage gets
    before its data-parallel sharding (activation checkpointing, :func:`ddpkit.parallel.parallelize.parallelize`);
    ``made(stage)``: what it gets once sharded, before its wrapper (a meta-built model's stage is made and
    initialised there: only this rank's stages ever take memory).
    """
    from torch.distributed import pipelining

    parallel = config.parallel
    per_rank = parallel.stages_per_rank
    total = layout.pp * per_rank
    every = _cut(model, total, parallel.split_points, split)
    # Stage i + P * v on pipeline rank i: the looped layout the interleaved schedules expect.
    ids = [layout.pp_rank + layout.pp * v for v in range(per_rank)]
    local = [prepare(every[i] if is_on_meta(every[i]) else every[i].to(runtime.device)) for i in ids]
    # Before the wrapping: fsdp2 replaces the parameters of the stages this rank shards (a tied head's matrix in
    # stage 0 no longer `is` the one in the last stage, which this rank does not shard).
    is_tied = tied_weight(every[-1]) is not None
    wrapped = [_data_parallel(stage, layout, config, runtime, made) for stage in local]
    torch_stages = [
        pipelining.PipelineStage(module, i, total, runtime.device, group=layout.pp_group)
        for module, i in zip(wrapped, ids)
    ]
    clock = StageClock(torch_stages)
    microbatches = microbatches_of(parallel)
    schedule_class = getattr(pipelining, _SCHEDULES[parallel.schedule])
    scale = config.train.loss_normalization != "tokens"
    argument = torch_stages if parallel.schedule in INTERLEAVED else torch_stages[0]
    timed_loss = clock.timed(loss, "stage loss")
    schedule = schedule_class(argument, n_microbatches=microbatches, loss_fn=timed_loss, scale_grads=scale)
    takes_tokens = any(getattr(stage, "documents", None) for stage in local)
    forward = PipelineForward(
        local, ids, total=total, device=runtime.device, group=layout.pp_group, takes_tokens=takes_tokens
    )
    # A LoRA model's stages save their adapter alone, as the whole model does
    held = adapter_only_parts(HeldParts(local, forward=forward), model)
    tied = TiedWeights(_shared_weight(local) if is_tied else None, _tied_group(layout) if is_tied else None)
    first = 0 in ids
    last = total - 1 in ids
    skip = {id(tied.weight)} if tied.weight is not None and not first else set()
    norm_parameters = [p for p in held.parameters() if id(p) not in skip]
    _log_layout(layout, every, ids, microbatches, parallel.schedule)
    theory = None if parallel.schedule in INTERLEAVED else bubble_fraction(layout.pp, microbatches)
    parts = (local, held, wrapped, schedule, microbatches, first, last, tied, norm_parameters, forward, clock)
    return Pipeline(*parts, layout.pp_rank, theory, takes_tokens=takes_tokens)


def _cut(
    model: nn.Module,
    total: int,
    split_points: list[str] | None,
    split: Callable[[nn.Module, int], list[nn.Module] | None] | None,
) -> list[nn.Module]:
    """Every stage module, in order: the Trainer's ``pipeline_stages(model, total)`` first; None: ddpkit's own cut."""
    if len(ddp_wrap.devices_of(model)) > 1:
        raise ConfigError(
            "parallel.pipeline: the model's parameters are on several devices (placed by hand); a pipeline places "
            "its stages itself: build the model on one device, or set parallel.pipeline=1"
        )
    every = split(model, total) if split is not None else None
    if every is None:
        every = split_model(model, stages=total, split_points=split_points)
    if len(every) != total:
        raise ValueError(f"the pipeline needs {total} stage modules, got {len(every)}")
    return every


def _data_parallel(
    stage: nn.Module, layout: ParallelLayout, config: Config, runtime: Runtime, made: Callable[[nn.Module], nn.Module]
) -> nn.Module:
    """A stage as its replicas hold it: sharded over them (fsdp2), in DDP over them (ddp, zero1), or as it is with
    one replica of ddp / zero1; ``made`` between the sharding and the wrapper."""
    way = layout.data_parallel
    stage = made(way.shard(stage, mesh=layout.dp_mesh, runtime=runtime))
    if way.replicated and layout.dp == 1:
        return stage
    wrapped = way.wrap(stage, runtime, config.ddp, group=layout.dp_group)
    if wrapped is not stage:
        # torch's stage reduces on the last microbatch's backward (it prepares DDP's reducer itself, and runs the
        # others under no_sync). A DDP forward would prepare the reducer for every microbatch, so every backward
        # would record its gradients for DDP's bucket rebuild (twice the parameters: an internal assert). Off, and
        # it stays off: no_sync() restores the value it found.
        wrapped.require_backward_grad_sync = False
    return wrapped


def _shared_weight(local: list[nn.Module]) -> torch.Tensor | None:
    """The tied matrix of a model that ties its head, where this rank holds it (its first or last stage)."""
    for stage in local:
        if getattr(stage, "embed", None) is not None:
            return stage.embed.weight
    return None


def _tied_group(layout: ParallelLayout) -> Any:
    """The group of this rank's first and last stage (the same data-parallel and tensor-parallel coordinates), for a
    model that ties its head; None on a middle stage."""
    # The mesh's ranks as (stage, every other coordinate): each column's first and last rank hold the tied matrix.
    grid = layout.mesh.mesh.reshape(layout.pp, -1).tolist()
    rank = dist.get_rank()
    mine = None
    # Every rank creates every column's group, in the same order (new_group is a collective).
    for first, last in zip(grid[0], grid[-1]):
        group = dist.new_group([first, last])
        if rank in (first, last):
            mine = group
    return mine


def _log_layout(layout: ParallelLayout, every: list[nn.Module], ids: list[int], microbatches: int, name: str) -> None:
    placement = "; ".join(
        f"stage {i}: blocks {','.join(stage_blocks(stage)) or '-'}"
        + (" + embeddings" if getattr(stage, "is_first", False) else "")
        + (" + head" if getattr(stage, "is_last", False) else "")
        for i, stage in enumerate(every)
    )
    if name in INTERLEAVED:
        theory = "interleaved"
    else:
        theory = f"{bubble_fraction(len(every), microbatches):.0%} in theory"
    log.info(
        "pipeline: %s; schedule %s, %d microbatches (bubble %s); %s; this rank holds stage(s) %s",
        layout.describe(),
        name,
        microbatches,
        theory,
        placement,
        ", ".join(map(str, ids)),
    )


class StageClock:
    """This rank's compute inside torch's schedule: each local stage's ``forward_one_chunk``, ``backward_one_chunk``
    (with DDP's all-reduce on the last microbatch) and ``perform_reduce_grad`` (FSDP2's reduce-scatter, the division
    by M), and the last stage's loss, each kept as a ``(name, start_ns, end_ns)`` span; busy time is their sum.

    torch has no hook for a stage's compute, so the clock wraps those public methods on the stage objects ddpkit
    built (instance attributes over the class's methods; the schedule calls them through the instance). What the
    schedule does besides, waiting for and posting its point-to-point transfers, is the stage's idle time.
    """

    def __init__(self, stages: list[Any]):
        self.spans: list[tuple[str, int, int]] = []
        for stage in stages:
            stage.forward_one_chunk = self.timed(stage.forward_one_chunk, "stage forward")
            stage.backward_one_chunk = self.timed(stage.backward_one_chunk, "stage backward")
            stage.perform_reduce_grad = self.timed(stage.perform_reduce_grad, "stage gradient reduce")

    def timed(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        """``fn`` recording a span ``name`` each call."""

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spans.append((name, start, time.time_ns()))

        return timed

    def take(self) -> tuple[float, list[tuple[str, int, int]]]:
        """The busy seconds and the spans since the last take; then empty."""
        spans = self.spans
        self.spans = []
        return sum(end - start for _, start, end in spans) / 1e9, spans
