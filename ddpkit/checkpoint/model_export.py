"""``model.pt``: the trained weights as a plain state_dict of CPU tensors, what inference loads on any machine.

    save_model(model, output_dir / "model.pt", rank=rank)   # every rank calls it; rank 0 writes

Under FSDP2 the shards are gathered first (a collective, hence every rank). Rank 0 refuses to write
weights that hold NaN or Inf, and writes atomically (a temporary file, fsync, rename).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.checkpoint import files as ckpt
from ddpkit.checkpoint.sharded_run import full_model_state
from ddpkit.errors import HealthError
from ddpkit.reporting.log import log
from ddpkit.training.replicas import require_finite

__all__ = ["save_model"]


def _gathered(weights: dict[str, Any], *, rank: int) -> dict[str, Any]:
    """Every rank's ``weights`` joined on rank 0 (a collective over every rank; empty elsewhere)."""
    parts = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(weights, parts, dst=0)
    if rank != 0:
        return {}
    whole: dict[str, Any] = {}
    for part in parts:
        whole.update(part)
    return whole


def save_model(model: torch.nn.Module, path: Path, *, rank: int, pipeline: Any = None) -> None:
    """The bare ``model``'s whole weights to ``path`` on rank 0 (every rank calls it: FSDP2 gathers).

    ``pipeline``: the layout of a pipeline, where ``model`` holds one rank's stages: replica 0's stages send theirs
    to rank 0, which writes the whole model under its own names (the same file as any other layout's).
    """
    if pipeline is None:
        weights = full_model_state(model)
    else:
        # Each stage's own tensors made whole (a tensor plan's or FSDP2's DTensors: a collective in their mesh),
        # not full_model_state's, which gathers them on rank 0 only, and rank 0 holds stage 0 alone.
        weights = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    # On the CPU, so the file loads on any machine
    weights = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in weights.items()}
    if pipeline is not None:
        first_copy = pipeline.dp_rank == 0 and pipeline.tp_rank == 0
        weights = _gathered(weights if first_copy else {}, rank=rank)
    if rank != 0:
        return
    # Rank 0 alone checks and writes the file
    require_finite(model, what=str(path), collective=False)
    for name, value in weights.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point() and not torch.isfinite(value).all():
            raise HealthError(f"{path}: {name} holds NaN or Inf; the file is not written")
    ckpt.save_atomically(weights, path)
    log.info("saved %s", path)
