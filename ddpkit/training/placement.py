"""Where a rank's model lives: the tensor plan first, then the pipeline's cut or FSDP2's shards.

    model, pipeline = place_model(whole, layout, cfg, runtime, plan=trainer.tensor_plan,
                                  split=trainer.pipeline_stages, loss=trainer.pipeline_loss)

``whole`` is the model as built, the same on every rank (one seed). The order is torchtitan's:

1. ``parallel.tensor`` > 1: the model's tensor plan (:mod:`ddpkit.parallel.tensor_plan`) over the layout's
   ``tp`` mesh, in place, so every parameter becomes a DTensor (sharded or replicated) on that mesh;
2. ``parallel.pipeline`` > 1: the model, tensor-parallel or not, is cut into stages and this rank keeps its own
   (:func:`ddpkit.training.pipeline_step.build_pipeline`); the stages' activations are plain tensors, since
   every tensor-parallel module hands back a local output;
3. otherwise ``fsdp2`` shards it over the layout's ``dp`` mesh (a 2-D (dp, tp) layout when tensor-parallel:
   FSDP2 shards each DTensor's local rows further), and ``ddp`` / ``zero1`` take it as it is (their wrapper comes
   later, in :func:`ddpkit.training.model_views.build_models`).

Activation checkpointing and the DDP wrapper come after, on the placed model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ddpkit.config.schema import Config
from ddpkit.distributed.layout import ParallelLayout
from ddpkit.distributed.process_group import Runtime
from ddpkit.distributed.sharding import shard_model
from ddpkit.reporting.log import log
from ddpkit.training.pipeline_step import Pipeline, build_pipeline

__all__ = ["place_model", "check_tensor_degree"]


def check_tensor_degree(config: Config) -> None:
    """Refuse a ``parallel.tensor`` that ddpkit's own model (``model.name: gpt``) cannot be split by, from its
    ``model.kwargs`` (heads, kv heads, MLP width and, with ``vocab_parallel``, the vocabulary divisible by T; no
    dropout), naming the valid degrees: in the Trainer's constructor, before any process group exists. A user's
    model is judged once built (:func:`_tensor_parallel`)."""
    parallel = config.parallel
    if parallel.tensor == 1 or config.model.name != "gpt":
        return
    # Imported here: the plans pull in DTensor, which a run without tensor parallelism never needs.
    from ddpkit.parallel.tensor_plan import check_tensor_plan

    check_tensor_plan(config.model.kwargs, parallel.tensor, vocab_parallel=parallel.vocab_parallel)


def place_model(
    whole: nn.Module,
    layout: ParallelLayout,
    config: Config,
    runtime: Runtime,
    *,
    plan: Callable[[nn.Module], Mapping[str, Any] | None] | None,
    split: Callable[[nn.Module, int], list[nn.Module]] | None,
    loss: Callable[[torch.Tensor, Any], torch.Tensor],
) -> tuple[nn.Module, Pipeline | None]:
    """This rank's model (under a pipeline, the parts it holds, under the whole model's names) and the pipeline.

    ``plan(model)``: the Trainer's ``tensor_plan``; None (or returning None): ddpkit's own model's plan. ``split``
    and ``loss``: the Trainer's ``pipeline_stages`` and ``pipeline_loss``.
    """
    model = whole
    if layout.tp > 1:
        model = _tensor_parallel(whole, layout, config, runtime, plan)
    if layout.pp > 1:
        pipeline = build_pipeline(model, layout, config, runtime, split=split, loss=loss)
        return pipeline.held, pipeline
    precision = config.train.precision
    return shard_model(model, runtime, config.parallel, precision=precision, mesh=layout.dp_mesh), None


def _tensor_parallel(
    model: nn.Module,
    layout: ParallelLayout,
    config: Config,
    runtime: Runtime,
    plan: Callable[[nn.Module], Mapping[str, Any] | None] | None,
) -> nn.Module:
    """``model`` split by its tensor plan over the layout's tensor mesh (collectives: the shards are scattered)."""
    # Imported here: the plans pull in DTensor's parallel styles, which runs without tensor parallelism never need.
    from ddpkit.parallel.tensor_plan import apply_tensor_parallel, check_tensor_plan, tensor_plan

    parallel = config.parallel
    # A user's model is judged here (its dropout); ddpkit's own were judged from model.kwargs before any group.
    check_tensor_plan(model, layout.tp, vocab_parallel=parallel.vocab_parallel)
    model = model.to(runtime.device)
    styles = plan(model) if plan is not None else None
    styles = dict(styles if styles is not None else tensor_plan(model, vocab_parallel=parallel.vocab_parallel))
    apply_tensor_parallel(model, layout.tp_mesh, styles)
    split = sorted({type(style).__name__ for style in styles.values()})
    log.info(
        "tensor parallelism: %d module(s) of %s split %d-way by its plan (%s); this rank is tensor rank %d",
        len(styles),
        type(model).__name__,
        layout.tp,
        ", ".join(split),
        layout.tp_rank,
    )
    return model
