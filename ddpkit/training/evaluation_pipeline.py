"""Validation under a pipeline: every validation batch forward through the stages, the metrics on the last one.

    forward = PipelineForward(stages, ids, total=P * V, device=device, group=layout.pp_group)   # build_pipeline's
    metrics = evaluate_pipeline(forward, held, loader, validation_step, device=device, autocast=autocast)

Each replica's stages read the same exact, duplicate-free shard of the validation set (the data-parallel
coordinate), so they see the same batches in the same order. The first stage feeds a batch's input to a forward-only
schedule of torch's (``schedule.eval``, one microbatch: the batch as it is), the middle stages pass it on, and on the
last stage the user's ``validation_step(batch)`` runs as without a pipeline: its ``self.model(x)`` is the held parts'
forward, which receives the previous stage's activations and returns the logits. The metrics are summed there and
reduced over every rank (the other stages add nothing), so they are the exact means over the whole validation set,
as a world of one computes them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ddpkit.parallel.data_parallel import DataParallel
from ddpkit.parallel.pipeline_forward import PipelineForward
from ddpkit.training.metrics import ExactMeans

__all__ = ["evaluate_pipeline"]


def evaluate_pipeline(
    forward: PipelineForward,
    model: nn.Module,
    loader: Any,
    step: Callable[[Any], Mapping[str, torch.Tensor]],
    *,
    device: torch.device,
    autocast: Callable[[], Any],
    data_parallel: DataParallel,
    forwards: int | None = None,
) -> dict[str, float]:
    """``step`` over every batch on the last stage, the forward through every stage; exact ``val_`` means.

    ``model`` (the held parts) is in eval mode meanwhile. Every rank calls it: the means are reduced over all.
    ``data_parallel``: how the stages' replicas hold their parameters. ``forwards``: under fsdp2, the count of
    forwards every replica runs, each stage gathering a unit at a time (a replica with fewer batches sends its last
    one through again, its metrics dropped); None: fsdp2 gathers each stage's parameters once for the pass.
    """
    from ddpkit.data.loaders import batch_size_of, move_to_device

    was_training = model.training
    model.eval()
    means = ExactMeans(device)
    try:
        with torch.no_grad(), autocast(), _held(forward.stages, data_parallel, lockstep=forwards is not None):
            seen, batch = 0, None
            for seen, batch in enumerate(loader, start=1):
                batch = move_to_device(batch, device)
                metrics = _through(forward, step, batch)
                if metrics is not None:
                    means.add(metrics, batch_size=batch_size_of(batch))
            for _ in range(seen, forwards or 0):
                _through(forward, step, batch)
    finally:
        model.train(was_training)
    return {f"val_{name}": value for name, value in means.compute().items()}


def _through(forward: PipelineForward, step: Callable[[Any], Mapping[str, torch.Tensor]], batch: Any) -> Any:
    """One batch forward through the stages: the metrics on the last stage, None on the others."""
    x = batch[0]
    if not forward.last:
        forward.run(x)
        return None
    with forward.expecting(x):
        return step(batch)


@contextlib.contextmanager
def _held(stages: list[nn.Module], data_parallel: DataParallel, *, lockstep: bool) -> Iterator[None]:
    """fsdp2: each stage gathering a unit at a time (``lockstep``: every replica runs as many forwards), or each
    stage's parameters gathered once for the whole pass; nothing for replicated stages."""
    with contextlib.ExitStack() as stack:
        for stage in stages:
            held = data_parallel.block_by_block if lockstep else data_parallel.full_parameters
            stack.enter_context(held(stage))
        yield
