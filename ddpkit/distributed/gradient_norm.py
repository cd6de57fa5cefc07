"""The global L2 norm of the gradients, and clipping by it, the same in every layout.

    total = gradient_norm(parameters, max_norm=1.0)                    # clipped in place; the norm returned
    total = gradient_norm(parameters, stages=layout.pp_group, counted=pipeline.norm_parameters)   # a pipeline's

FSDP2's and a tensor plan's gradients are DTensors whose norm is a partial value per rank: it is made whole (one
all-reduce) before clipping, as torchtitan does. Under a pipeline each stage holds some of the parameters: the
squares add up over the stages. Without clipping the norm of DDP's flat gradient buckets is read directly.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = ["gradient_norm"]


def gradient_norm(
    parameters: list[torch.Tensor], max_norm: float | None = None, *, stages: Any = None, counted: Any = None
) -> torch.Tensor:
    """The global L2 norm of the gradients (clipped to ``max_norm`` when given), the same in every mode.

    FSDP2's gradients are DTensor shards whose norm is a partial value per rank; it is made whole
    (one all-reduce) before clipping, as torchtitan does, or each rank would clip by its own shard.
    ``stages``: a pipeline's process group, whose ranks each hold some of the parameters: the squares of the
    ``counted`` parameters (a tied matrix once) are summed over it, and every stage clips by that one norm.
    """
    if stages is not None:
        return _pipeline_norm(parameters, counted, max_norm, stages)
    grads = [p.grad for p in parameters if p.grad is not None]
    if max_norm is None and (buckets := _bucket_buffers(grads)) is not None:
        # The same values read as DDP's flat buckets (``ddp.gradient_as_bucket_view``): one dot product
        # per bucket, on memory the all-reduce just wrote (52 -> 18 us in the MLP's loop). Not for
        # clipping, whose norm must have torch's own bits: another summation order differs in the last
        # bits. Finite exactly when every gradient is (and, as torch's norm, inf past 1.8e19).
        if len(buckets) == 1:
            squares = torch.dot(buckets[0], buckets[0])
        else:
            squares = torch.stack([torch.dot(b, b) for b in buckets]).sum()
        return squares.sqrt()
    total = _whole_norm(grads)
    if max_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
    return total


def _whole_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of ``grads`` as a plain tensor: a DTensor's (FSDP2's or a tensor plan's) made whole."""
    if (
        grads
        and grads[0].is_cpu
        and all(type(g) is torch.Tensor and g.is_cpu and g.dtype == grads[0].dtype for g in grads)
    ):
        # On the CPU get_total_norm groups the tensors and takes one vector_norm per tensor in
        # Python (60 us a step on the test MLP); _foreach_norm runs the same kernels in one call
        # (20 us), so the same bits. Elsewhere it already uses _foreach_norm per device and dtype.
        total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    else:
        total = torch.nn.utils.get_total_norm(grads)
    if hasattr(total, "full_tensor"):
        total = total.full_tensor()
    return total


def _pipeline_norm(
    parameters: list[torch.Tensor], counted: list[torch.Tensor], max_norm: float | None, stages: Any
) -> torch.Tensor:
    grads = [p.grad for p in counted if p.grad is not None]
    if grads:
        squares = _whole_norm(grads) ** 2
    else:
        squares = torch.zeros((), device=parameters[0].device if parameters else None)
    # Each stage holds some of the parameters: the squares add up over the pipeline.
    torch.distributed.all_reduce(squares, group=stages)
    total = squares.sqrt()
    if max_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
    return total


#: The last tiling found: weak references to the gradients and to their buckets. DDP hands out the same
#: bucket views as gradients every step; weak, so a finished run's buckets are not kept alive by this.
_last_tiling: tuple[tuple[weakref.ref, ...], list[weakref.ref]] | None = None


def _bucket_buffers(grads: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """The flat buffers that ``grads`` are views of, when they tile them exactly (DDP's buckets under
    ``gradient_as_bucket_view``: each gradient a slice of one bucket, every bucket element a gradient); else None.

    Checked once for a set of gradient objects, then remembered: the step path checks that it holds
    the very same objects (0.71 us instead of 2.13 for the MLP's six gradients, `timeit`)."""
    global _last_tiling
    cached = _last_tiling is not None and len(_last_tiling[0]) == len(grads)
    if cached and all(ref() is g for ref, g in zip(_last_tiling[0], grads)):
        # Alive: the gradients are views of them.
        flat = [ref() for ref in _last_tiling[1]]
        if all(b is not None for b in flat):
            return flat
    flat = _tiled_buffers(grads)
    _last_tiling = (tuple(map(weakref.ref, grads)), [weakref.ref(b) for b in flat]) if flat is not None else None
    return flat


def _tiled_buffers(grads: list[torch.Tensor]) -> list[torch.Tensor] | None:
    buffers: dict[int, torch.Tensor] = {}
    for grad in grads:
        # Not a DTensor shard or another subclass.
        base = grad._base if type(grad) is torch.Tensor else None
        if base is None:
            return None
        buffers[id(base)] = base
    flat = list(buffers.values())
    if not flat or sum(b.numel() for b in flat) != sum(g.numel() for g in grads):
        return None
    # 1-D float32/float64 only: a sum of squares in fp16 would overflow at a norm of 256 (torch's norm does not).
    return flat if all(b.dim() == 1 and b.dtype in (torch.float32, torch.float64) for b in flat) else None
