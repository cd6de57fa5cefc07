"""What each rank holds: parameters, gradients and optimizer state in bytes, per ``parallel.mode``.

    held = rank_bytes(model, optimizer)            # this rank, now: RankBytes(parameters, gradients, optimizer)
    log_rank_bytes(model, optimizer, layout="data-parallel 2 (fsdp2)")   # every rank's numbers, logged (a collective)
    adam_temporaries(optimizer)        # the line it adds under torch's default Adam / AdamW: their temporaries, the fix
    plan = zero_bytes(shapes, world_size=2, slots=2, element_size=4)   # the same, from shapes only (zero1)

``rank_bytes`` measures the tensors a rank really owns (an FSDP2 parameter's local shard, the
optimizer state of ZeRO-1's partition). Gradients and optimizer state do not exist before the
first step, so at startup they are counted as they will be: one gradient per trainable parameter
element, ``slots`` state tensors per parameter element (Adam/AdamW 2, SGD with momentum 1).
``replicated_bytes``, ``zero_bytes`` and ``fsdp_bytes`` compute the same from parameter shapes with
torch's own partition rules (ZeRO's greedy by-size assignment, FSDP2's dim-0 ``torch.chunk``), so
``ddpkit estimate`` can predict it on the meta device.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "RankBytes",
    "rank_bytes",
    "optimizer_slots",
    "log_rank_bytes",
    "adam_temporaries",
    "replicated_bytes",
    "zero_bytes",
    "fsdp_bytes",
    "format_bytes",
]

log = logging.getLogger("ddpkit")


@dataclass(frozen=True)
class RankBytes:
    """Bytes one rank holds; ``optimizer`` is None when the optimizer's state size is unknown before a step."""

    parameters: int
    gradients: int
    optimizer: int | None

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + (self.optimizer or 0)


def _local(t: torch.Tensor) -> torch.Tensor:
    # A DTensor's shard on this rank.
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(t: torch.Tensor) -> int:
    local = _local(t)
    return local.numel() * local.element_size()


def optimizer_slots(optimizer: torch.optim.Optimizer) -> int | None:
    """State tensors per parameter element the optimizer will keep (None: not a class ddpkit knows)."""
    # ZeroRedundancyOptimizer wraps the real one.
    inner = getattr(optimizer, "optim", optimizer)
    if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
        return 3 if any(g.get("amsgrad") for g in inner.param_groups) else 2
    if isinstance(inner, torch.optim.SGD):
        return 1 if any(g.get("momentum") for g in inner.param_groups) else 0
    return None


def _owned_parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    inner = getattr(optimizer, "optim", optimizer)
    return [p for group in inner.param_groups for p in group["params"]]


def rank_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> RankBytes:
    """What this rank holds now; state that does not exist yet is counted as it will be."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    parameters = sum(_nbytes(p) for p in model.parameters())
    gradients = sum(_nbytes(p.grad) if p.grad is not None else _nbytes(p) for p in trainable)
    owned = _owned_parameters(optimizer)
    inner = getattr(optimizer, "optim", optimizer)
    if any(inner.state.get(p) for p in owned):
        state = sum(
            _nbytes(v)
            for p in owned
            for v in inner.state.get(p, {}).values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        )
    else:
        slots = optimizer_slots(optimizer)
        state = None if slots is None else slots * sum(_nbytes(p) for p in owned)
    return RankBytes(parameters, gradients, state)


def format_bytes(n: int | None, *, exact: bool = True, unknown: str = "unknown until the first step") -> str:
    """``7.11 MiB (7,456,000 B)``; ``exact=False``: ``7.11 MiB``; ``unknown`` for None."""
    if n is None:
        return unknown
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit} ({n:,} B)" if exact else f"{n / size:.2f} {unit}"
    return f"{n:,} B" if exact else f"{n} B"


def log_rank_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, *, layout: str) -> list[RankBytes]:
    """Gather every rank's :func:`rank_bytes` and log them on rank 0 (call on every rank); ``layout`` describes how
    the ranks hold the model (the parallel layout's own description)."""
    import torch.distributed as dist

    mine = rank_bytes(model, optimizer)
    ranks = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
    count = sum(p.numel() for p in model.parameters())
    lines = [
        f"rank {r}: parameters {format_bytes(b.parameters)}, gradients {format_bytes(b.gradients)}, "
        f"optimizer state {format_bytes(b.optimizer)}"
        for r, b in enumerate(ranks)
    ]
    log.info("%s: %s parameters; what each rank holds:\n  %s", layout, f"{count:,}", "\n  ".join(lines))
    note = adam_temporaries(optimizer)
    if note is not None:
        log.info("%s", note)
    return ranks


def adam_temporaries(optimizer: torch.optim.Optimizer) -> str | None:
    """One line naming the temporaries of torch's default Adam / AdamW on this rank, above what it holds, and the
    fix; None for another optimizer or an implementation the user chose (``fused``, ``foreach`` set).

    torch's default on the CPU is a loop that makes two temporaries the size of each parameter in turn (the largest
    sets the peak: a vocabulary matrix); on CUDA it is ``foreach``, whose square root of the second moments is one
    more tensor per parameter at once: a fourth more than parameters, gradients and state. The fused kernel
    (``optim.kwargs.fused: true``; torchtitan's default) makes neither."""
    inner = getattr(optimizer, "optim", optimizer)
    if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
        return None
    groups = inner.param_groups
    if any(g.get("fused") is not None or g.get("foreach") is not None for g in groups):
        return None
    params = [p for g in groups for p in g["params"]]
    if not params:
        return None
    name = type(inner).__name__
    if all(p.device.type == "cuda" for p in params):
        extra = sum(_nbytes(p) for p in params)
        how = f"foreach, one more tensor per parameter at once ({format_bytes(extra, exact=False)} on this rank)"
    else:
        extra = 2 * max(_nbytes(p) for p in params)
        how = f"a loop, two temporaries the size of each parameter ({format_bytes(extra, exact=False)} at the largest)"
    return (
        f"optim: torch's default {name} runs {how}, above what the rank holds; optim.kwargs.fused: true makes none "
        "(the same state, rounded by another kernel)"
    )


def replicated_bytes(
    shapes: Sequence[tuple[int, ...]], *, world_size: int, slots: int, element_size: int = 4
) -> list[RankBytes]:
    """Per-rank bytes when every replica holds everything (ddp), from the trainable parameter shapes alone."""
    full = sum(math.prod(s) for s in shapes) * element_size
    return [RankBytes(full, full, slots * full)] * world_size


def zero_bytes(
    shapes: Sequence[tuple[int, ...]], *, world_size: int, slots: int, element_size: int = 4
) -> list[RankBytes]:
    """Per-rank bytes under ZeRO-1: whole parameters and gradients, the optimizer state of the rank's partition."""
    sizes = [math.prod(s) for s in shapes]
    full = sum(sizes) * element_size
    owned = _zero_partition(sizes, world_size)
    return [RankBytes(full, full, slots * n * element_size) for n in owned]


def fsdp_bytes(
    shapes: Sequence[tuple[int, ...]], *, world_size: int, slots: int, element_size: int = 4
) -> list[RankBytes]:
    """Per-rank bytes under FSDP2: each rank's dim-0 chunk of every parameter, its gradient and its state."""
    local = [sum(_chunk_numel(s, world_size, rank) for s in shapes) * element_size for rank in range(world_size)]
    return [RankBytes(n, n, slots * n) for n in local]


def _zero_partition(sizes: Sequence[int], world_size: int) -> list[int]:
    """Elements each rank owns under ZeroRedundancyOptimizer's rule: largest first, to the least-loaded rank."""
    owned = [0] * world_size
    for n in sorted(sizes, reverse=True):
        rank = owned.index(min(owned))
        owned[rank] += n
    return owned


def _chunk_numel(shape: tuple[int, ...], world_size: int, rank: int) -> int:
    """FSDP2's shard of one parameter on ``rank``: ``torch.chunk`` along dim 0 (scalars count as one row)."""
    rows = shape[0] if shape else 1
    per = math.ceil(rows / world_size)
    mine = max(0, min(per, rows - rank * per))
    return mine * math.prod(shape[1:])
