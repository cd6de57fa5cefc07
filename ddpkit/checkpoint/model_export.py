"""``model.pt``: the trained weights as a plain state_dict of CPU tensors, what inference loads on any machine.

    save_model(model, output_dir / "model.pt", rank=rank)   # every rank calls it; rank 0 writes

Whether a run writes it is ddpkit.checkpoint.final_outputs's rule (``checkpoint.model_pt``). Under FSDP2 the shards are
gathered first (a collective, hence every rank); under a pipeline each stage's tensors are sent to rank 0 one at a
time, so rank 0 holds the whole model once. Rank 0 refuses to write weights that hold NaN or Inf, and writes
atomically (a temporary file, fsync, rename).
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


def _whole(value: torch.Tensor) -> torch.Tensor:
    """A DTensor made whole (a collective in its mesh), a plain tensor as it is."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _described(name: str, value: Any) -> tuple[str, tuple[int, ...] | None, Any]:
    """``(name, shape, dtype)`` of a tensor; ``(name, None, value)`` of anything else."""
    if isinstance(value, torch.Tensor):
        return name, tuple(value.shape), value.dtype
    return name, None, value


def _stages_to_rank0(model: torch.nn.Module, *, pipeline: Any, rank: int) -> dict[str, torch.Tensor]:
    """Every stage's tensors, whole, on rank 0's CPU, sent one tensor at a time (a collective; empty elsewhere).

    Rank 0 learns what each stage's first copy (data-parallel and tensor rank 0) sends: names, shapes, dtypes, a few
    bytes each. Then each rank makes its tensors whole one at a time (a tensor plan's or FSDP2's DTensors: every rank
    of their mesh takes part), the first copies sending each, and rank 0 receives them stage by stage into the
    buffers the file keeps: it holds the whole model once (an object gather held every stage pickled and unpickled
    at once), and a sender never more than one whole tensor beyond its part."""
    state = model.state_dict()
    first_copy = pipeline.dp_rank == 0 and pipeline.tp_rank == 0
    # A DTensor's shape is the whole tensor's; a value that is no tensor (a LoRA base's digest) travels here whole
    listing = [_described(name, value) for name, value in state.items()] if first_copy else []
    listings = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(listing, listings, dst=0)
    # NCCL moves device tensors only, Gloo both
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in dist.get_backend() else None
    whole: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            whole[name] = value
            continue
        tensor = _whole(value)
        if rank == 0:
            whole[name] = tensor.cpu()
        elif first_copy:
            dist.send(tensor.to(device or tensor.device).contiguous(), dst=0)
    if rank != 0:
        return {}
    for source, described in enumerate(listings[1:], start=1):
        for name, shape, dtype in described:
            if shape is None:
                whole[name] = dtype
                continue
            buffer = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(buffer, src=source)
            whole[name] = buffer.cpu()
    return whole


def save_model(model: torch.nn.Module, path: Path, *, rank: int, pipeline: Any = None) -> None:
    """The bare ``model``'s whole weights to ``path`` on rank 0 (every rank calls it: FSDP2 gathers).

    ``pipeline``: the layout of a pipeline, where ``model`` holds one rank's stages: replica 0's stages send theirs
    to rank 0, one tensor at a time, which writes the whole model under its own names (the same file as any other
    layout's).
    """
    if pipeline is None:
        # On the CPU, so the file loads on any machine
        weights = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in full_model_state(model).items()}
    else:
        # Not full_model_state's gather, on rank 0 only: rank 0 holds stage 0 alone
        weights = _stages_to_rank0(model, pipeline=pipeline, rank=rank)
    if rank != 0:
        return
    # Rank 0 alone checks and writes the file
    require_finite(model, what=str(path), collective=False)
    for name, value in weights.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point() and not torch.isfinite(value).all():
            raise HealthError(f"{path}: {name} holds NaN or Inf; the file is not written")
    ckpt.save_atomically(weights, path)
    log.info("saved %s", path)
