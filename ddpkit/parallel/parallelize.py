"""Where a rank's model lives and how it trains: one function, in one readable order, returning one value.

    placed = parallelize(whole, layout, cfg, runtime, plan=styles, split=trainer.pipeline_stages,
                         loss=trainer.pipeline_loss)
    placed.models.train, placed.models.eval, placed.models.bare   # what training calls, validation calls, is saved
    placed.pipeline                                               # this rank's stages and schedule, or None

``whole`` is the model as built, the same on every rank (one seed). The order is torchtitan's:

1. ``parallel.tensor`` > 1: the tensor plan (the model's own, or ``plan``) over the layout's ``tp`` mesh, in place,
   so every parameter becomes a DTensor (sharded or replicated) on that mesh;
2. ``parallel.pipeline`` > 1: the model, tensor-parallel or not, is cut into stages and this rank keeps its own
   (:func:`ddpkit.parallel.pipeline.build_pipeline`), each stage going through steps 3 and 4 itself; otherwise the
   whole model is the one part;
3. activation checkpointing on the part (``train.activation_checkpointing``), and channels_last if asked;
4. the layout's way of holding parameters (:mod:`ddpkit.parallel.data_parallel`): FSDP2 shards the part over the
   ``dp`` mesh (a 2-D (dp, tp) layout when tensor-parallel);
5. a model built on the meta device (:mod:`ddpkit.parallel.meta_build`) is made now, the part only, its shards
   only, on the rank's device, and initialised by parameter name; steps 1 to 4 ran on meta, with no memory;
6. DDP wraps the part (ddp, zero1), then ``torch.compile`` (:mod:`ddpkit.parallel.model_views`); under fsdp2 or
   inside a pipeline ``torch.compile`` runs in step 3 instead, each block on its own after activation checkpointing
   and before the sharding (:mod:`ddpkit.parallel.block_compile`, torchtitan's order);
7. ``parallel.tensor`` > 1: the tensor plan's gradient hooks go on the parameters as now placed
   (:func:`ddpkit.parallel.tensor_plan.hook_gradients`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ddpkit.config.schema import Config
from ddpkit.distributed.process_group import Runtime
from ddpkit.models.accumulate_in_place import rebind_vocabulary
from ddpkit.models.init_by_name import is_on_meta
from ddpkit.parallel.activation_checkpointing import apply_activation_checkpointing
from ddpkit.parallel.block_compile import compile_blocks, compiles_per_block
from ddpkit.parallel.data_parallel import DataParallel
from ddpkit.parallel.layout import ParallelLayout
from ddpkit.parallel.meta_build import materialize
from ddpkit.parallel.model_views import CompileWatch, Models, build_models, compile_settings, to_channels_last
from ddpkit.parallel.pipeline import Pipeline, build_pipeline
from ddpkit.parallel.pipeline_split import TiedWeights
from ddpkit.reporting.log import log

__all__ = ["Placed", "parallelize", "check_tensor_degree"]


@dataclass(frozen=True)
class Placed:
    """What this rank holds of the model and how it trains it: the one value placement returns."""

    #: The views of the held model: ``train`` (wrapped, compiled), ``eval`` and ``bare`` (under the whole model's
    #: names: under a pipeline, the parts this rank holds).
    models: Models
    #: This rank's stages, torch's stages and schedule; None without a pipeline.
    pipeline: Pipeline | None
    #: How the data-parallel replicas hold parameters (the layout's).
    data_parallel: DataParallel
    #: Under a pipeline, the whole model's parameter names in its optimizer's order: a single-file checkpoint's
    #: optimizer state is keyed by that position, and this rank finds its own parameters in it. None otherwise.
    optimizer_order: list[str] | None = None
    #: Whether the tensor plan sharded the vocabulary (``parallel.vocab_parallel`` resolved for this model): the
    #: logits are then a vocabulary-sharded DTensor, and the step runs its losses under ``loss_parallel()``.
    vocab_parallel: bool = False

    @property
    def held(self) -> nn.Module:
        """The bare model this rank holds, under the whole model's names: what is saved and optimized."""
        return self.models.bare

    @property
    def parts(self) -> list[nn.Module]:
        """What training runs: each local stage as wrapped, or the whole model's one training view."""
        return self.pipeline.wrapped if self.pipeline is not None else [self.models.train]

    @property
    def tied(self) -> TiedWeights | None:
        """A pipeline's tied embedding and head (one matrix in two stages); None without a pipeline."""
        return self.pipeline.tied if self.pipeline is not None else None


def check_tensor_degree(config: Config) -> None:
    """Refuse a ``parallel.tensor`` that ddpkit's own model (``model.name: gpt``) cannot be split by, from its
    ``model.kwargs`` (heads, kv heads, MLP width and, with ``vocab_parallel``, the vocabulary divisible by T; no
    dropout), naming the valid degrees: in the Trainer's constructor, before any process group exists. A user's
    model is judged once built (:func:`_tensor_parallel`)."""
    parallel = config.parallel
    if parallel.tensor == 1 or config.model.name != "gpt":
        return
    # Imported here: the plans pull in DTensor, which a run without tensor parallelism never needs.
    from ddpkit.parallel.tensor_plan import check_tensor_plan, vocab_parallel_for

    vocab_parallel = vocab_parallel_for(config.model.kwargs, parallel.tensor, parallel.vocab_parallel)
    # dist.device auto: CUDA where there is one, as the runtime will choose (dropout splits on CUDA only)
    device = config.dist.device if config.dist.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    split = {"vocab_parallel": vocab_parallel, "sequence_parallel": parallel.sequence_parallel}
    check_tensor_plan(config.model.kwargs, parallel.tensor, **split, device=device)


def parallelize(
    whole: nn.Module,
    layout: ParallelLayout,
    config: Config,
    runtime: Runtime,
    *,
    plan: Mapping[str, Any] | None = None,
    split: Callable[[nn.Module, int], list[nn.Module] | None] | None = None,
    loss: Callable[[torch.Tensor, Any], torch.Tensor] | None = None,
    optimizer_order: list[str] | None = None,
) -> Placed:
    """This rank's part of ``whole``, placed, wrapped and compiled as the config says (the module's order).

    ``plan``: torch's ParallelStyle objects by module name (the Trainer's ``tensor_plan``); None: the model's own.
    ``split`` and ``loss``: the Trainer's ``pipeline_stages`` and ``pipeline_loss``, used under a pipeline, with
    ``optimizer_order`` (the whole model's names in its optimizer's order: ddpkit.training.param_groups), which the
    placed value carries to the checkpoint.
    """
    way = layout.data_parallel
    made = _maker(whole, runtime.device)
    model = whole
    vocab_parallel = False
    if layout.tp > 1:
        model, vocab_parallel = _tensor_parallel(whole, layout, config, runtime, plan)
    prepare = _prepare(config, layout)
    if layout.pp > 1:
        pipeline = build_pipeline(model, layout, config, runtime, split=split, loss=loss, prepare=prepare, made=made)
        settings = compile_settings(config.train.compile)
        # The stages' blocks were compiled in prepare: the watch times and caps their compilations.
        watch = CompileWatch(settings.recompile_limit) if settings is not None else None
        models = Models(train=pipeline.held, eval=pipeline.held, bare=pipeline.held, data_parallel=way, watch=watch)
        placed = Placed(models, pipeline, way, optimizer_order, vocab_parallel=vocab_parallel)
    else:
        model = made(way.shard(prepare(model), mesh=layout.dp_mesh, runtime=runtime))
        options = dict(ddp=config.ddp, train=config.train, data_parallel=way, group=layout.dp_group)
        models = build_models(model, runtime, **options, blocks_compiled=compiles_per_block(layout))
        placed = Placed(models, None, way, vocab_parallel=vocab_parallel)
    if layout.tp > 1:
        from ddpkit.parallel.tensor_plan import hook_gradients

        # The tensor plan's gradient hooks, on the parameters as they are now: building on the meta device made new
        # ones since the plan was applied (to_empty), without the meta ones' hooks.
        hook_gradients(placed.held)
    return placed


def _maker(whole: nn.Module, device: torch.device) -> Callable[[nn.Module], nn.Module]:
    """What a part gets once sharded, before its wrapper: made on the device and initialised by name when ``whole``
    was built on the meta device (ddpkit.parallel.meta_build), else nothing (it was built whole)."""
    if not is_on_meta(whole):
        return lambda part: part
    return lambda part: materialize(part, whole, device)


def _prepare(config: Config, layout: ParallelLayout) -> Callable[[nn.Module], nn.Module]:
    """What every part gets before its data-parallel wrapper: activation checkpointing, then channels_last, then
    under fsdp2 or inside a pipeline ``train.compile`` block by block (its blocks: FSDP2's units)."""
    train = config.train
    settings = compile_settings(train.compile) if compiles_per_block(layout) else None
    names = getattr(layout.data_parallel, "blocks", None)

    def prepare(part: nn.Module) -> nn.Module:
        # a plain embedding's and head's micro-batch gradients added into .grad in place (no second vocabulary matrix)
        rebind_vocabulary(part)
        apply_activation_checkpointing(part, train.activation_checkpointing)
        if train.channels_last:
            part = to_channels_last(part)
        if settings is not None:
            compile_blocks(part, settings, names=names)
        return part

    return prepare


def _tensor_parallel(
    model: nn.Module, layout: ParallelLayout, config: Config, runtime: Runtime, plan: Mapping[str, Any] | None
) -> tuple[nn.Module, bool]:
    """``model`` split by its tensor plan over the layout's tensor mesh (collectives: the shards are scattered), and
    whether the plan sharded the vocabulary."""
    # Imported here: the plans pull in DTensor's parallel styles, which runs without tensor parallelism never need.
    from ddpkit.parallel.tensor_plan import apply_tensor_parallel, check_tensor_plan, tensor_plan, vocab_parallel_for

    setting = config.parallel.vocab_parallel
    # A user's plan shards the vocabulary only where it says so, and then the user sets vocab_parallel: true.
    vocab_parallel = bool(setting) if plan is not None else vocab_parallel_for(model, layout.tp, setting)
    # A user's model is judged here (its dropout); ddpkit's own were judged from model.kwargs before any group.
    # A user's plan lays out its own sequence: parallel.sequence_parallel is for ddpkit's plans (refused otherwise).
    split = {"vocab_parallel": vocab_parallel, "sequence_parallel": config.parallel.sequence_parallel}
    check_tensor_plan(model, layout.tp, **split, device=runtime.device.type)
    if not is_on_meta(model):
        model = model.to(runtime.device)
    styles = dict(plan if plan is not None else tensor_plan(model, **split))
    apply_tensor_parallel(model, layout.tp_mesh, styles)
    if config.parallel.sequence_parallel:
        # what a pipeline's later stages read their whole sequence's length by (ddpkit.parallel.pipeline_split)
        model.sequence_split = layout.tp
    log.info(
        "tensor parallelism: %d module(s) of %s split %d-way by its plan (%s), the vocabulary %s, the sequence %s; "
        "this rank is tensor rank %d",
        len(styles),
        type(model).__name__,
        layout.tp,
        ", ".join(sorted({type(style).__name__ for style in styles.values()})),
        "sharded" if vocab_parallel else "replicated",
        "split" if config.parallel.sequence_parallel else "whole",
        layout.tp_rank,
    )
    return model, vocab_parallel
