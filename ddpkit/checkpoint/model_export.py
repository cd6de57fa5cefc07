"""``model.pt``: the trained weights as a plain state_dict of CPU tensors, what inference loads on any machine.

    save_model(model, output_dir / "model.pt", rank=rank)   # every rank calls it; rank 0 writes

Under FSDP2 the shards are gathered first (a collective, hence every rank). Rank 0 refuses to write
weights that hold NaN or Inf, and writes atomically (a temporary file, fsync, rename).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ddpkit.checkpoint import files as ckpt
from ddpkit.checkpoint.sharded_run import full_model_state
from ddpkit.reporting.log import log
from ddpkit.training.replicas import require_finite

__all__ = ["save_model"]


def save_model(model: torch.nn.Module, path: Path, *, rank: int) -> None:
    """The bare ``model``'s whole weights to ``path`` on rank 0 (every rank calls it: FSDP2 gathers)."""
    weights = full_model_state(model)
    # On the CPU, so the file loads on any machine
    weights = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in weights.items()}
    if rank != 0:
        return
    # Rank 0 alone checks and writes the file
    require_finite(model, what=str(path), collective=False)
    ckpt.save_atomically(weights, path)
    log.info("saved %s", path)
