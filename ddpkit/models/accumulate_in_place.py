"""The vocabulary matrices' gradients added into ``.grad`` where it already exists, never made whole beside it.

    rebind_vocabulary(stage)                        # its plain `embed` and `head`, if it has them
    embedding(ids, local_rows, grad_of(weight))     # the lookup itself, for a style that holds rows as DTensors
    linear(x, local_rows, grad_of(weight))          # the head's product, the same way

With micro-batches (a pipeline's, ``train.grad_accum_steps``), autograd makes each micro-batch's gradient of a
parameter as a new tensor and then adds it into ``.grad``. For the embedding and the output head that new tensor
is a whole ``[vocab, dim]`` matrix (125 MiB at a 32,000 x 1,024 vocabulary in fp32) made beside the one already
accumulated: the peak of a pipeline's first stage (the embedding's backward) and of its last (the head's), and
under tensor parallelism a shard's worth on every rank. Megatron-LM's "gradient accumulation fusion" adds the
product into ``.grad`` directly; these functions do the same, from the second micro-batch on:

- **the embedding**: autograd's own embedding backward runs over the micro-batch's distinct ids alone, a
  ``[distinct ids, dim]`` tensor, whose rows are then added to those rows of ``.grad``;
- **the head**: the weight's gradient ``grad_outputᵀ · x`` is made a block of rows at a time (8 MiB), each block
  added to its rows of ``.grad`` and freed.

Both give autograd's bits: a row of the sum is the same sum in the same order, and a block of rows of a matrix
product is those rows of the whole product (checked on torch's CPU BLAS by ``tests/test_accumulate_in_place.py``,
which fails if it ever is not). On the first micro-batch (no ``.grad`` yet) autograd's own gradient is handed on
as it is. Afterwards the backward hands autograd a zero that takes no memory (``expand`` of one element), so
``AccumulateGrad`` and every hook on it still run (DDP's reducer marks the parameter ready there).

Where it stays out, taking autograd's own path: under ``torch.compile`` (a graph cannot branch on ``.grad``), under
autocast (its casts would have to be replayed), for a frozen matrix (a LoRA base), and for a tied matrix used twice in
one module tree (autograd sums the two uses before it adds them, in another order).
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Accumulated", "embedding", "grad_of", "linear", "rebind_vocabulary"]

#: The bytes of one block of the head's weight gradient made at a time.
BLOCK_BYTES = 8 * 2**20

#: Where a matrix's gradient accumulates, as a plain tensor laid out as the matrix is (or None before the first).
Accumulated = Callable[[], torch.Tensor | None]


def embedding(ids: torch.Tensor, rows: torch.Tensor, accumulated: Accumulated) -> torch.Tensor:
    """``F.embedding(ids, rows)``, whose backward adds into ``accumulated()`` in place once it exists."""
    if not _fuses(rows):
        return F.embedding(ids, rows)
    return _Embedding.apply(ids, rows, accumulated)


def linear(x: torch.Tensor, rows: torch.Tensor, accumulated: Accumulated) -> torch.Tensor:
    """``F.linear(x, rows)`` (no bias), whose backward adds the weight's gradient into ``accumulated()`` in place
    once it exists."""
    if not _fuses(rows) or torch.is_autocast_enabled(x.device.type):
        return F.linear(x, rows)
    return _Linear.apply(x, rows, accumulated)


def rebind_vocabulary(part: nn.Module) -> list[str]:
    """Give ``part``'s plain ``embed`` (an ``nn.Embedding``) and bias-free ``head`` (an ``nn.Linear``), where it has
    them, forwards that accumulate in place; the names of those rebound.

    Left alone: a DTensor matrix (a tensor plan's style computes it: ddpkit's own do this themselves), a
    ``padding_idx`` or ``max_norm``, a head with a bias, and a matrix the part uses twice (tied)."""
    embed, head = getattr(part, "embed", None), getattr(part, "head", None)
    tied = isinstance(embed, nn.Embedding) and isinstance(head, nn.Linear) and embed.weight is head.weight
    rebound = []
    if _plain(embed, nn.Embedding) and not tied and embed.padding_idx is None and embed.max_norm is None:
        embed.forward = types.MethodType(_embed_forward, embed)
        rebound.append("embed")
    if _plain(head, nn.Linear) and not tied and head.bias is None:
        head.forward = types.MethodType(_head_forward, head)
        rebound.append("head")
    return rebound


def _plain(module: nn.Module | None, kind: type[nn.Module]) -> bool:
    """Whether ``module`` is a ``kind`` computing with its class's forward on a plain matrix: not one a tensor
    plan's style placed (a DTensor, even on the meta device) or whose forward something else set."""
    return isinstance(module, kind) and not _is_dtensor(module.weight) and "forward" not in vars(module)


def grad_of(param: torch.Tensor) -> Accumulated:
    """Where ``param``'s gradient accumulates, as a plain tensor: its ``.grad``, a DTensor's local shard of it."""

    def accumulated() -> torch.Tensor | None:
        grad = param.grad
        return grad.to_local() if grad is not None and _is_dtensor(grad) else grad

    return accumulated


def _embed_forward(module: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """An ``nn.Embedding``'s forward, accumulating in place (:func:`rebind_vocabulary`)."""
    return embedding(ids, module.weight, grad_of(module.weight))


def _head_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A bias-free ``nn.Linear``'s forward, accumulating in place (:func:`rebind_vocabulary`)."""
    return linear(x, module.weight, grad_of(module.weight))


def _fuses(rows: torch.Tensor) -> bool:
    """Whether the in-place path applies: a trainable matrix in eager mode with gradients on."""
    return rows.requires_grad and torch.is_grad_enabled() and not torch.compiler.is_compiling()


def _is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor (imported lazily: a run without one never loads DTensor)."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _no_memory_zero(like: torch.Tensor) -> torch.Tensor:
    """A zero of ``like``'s shape that holds one element: what autograd adds to ``.grad`` once it was added to."""
    return like.new_zeros(()).expand(like.shape)


class _Embedding(torch.autograd.Function):
    """The lookup; its backward adds each distinct id's summed rows into the accumulated gradient in place."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, rows: torch.Tensor, accumulated: Accumulated) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.accumulated, ctx.rows_shape = accumulated, rows.shape
        return F.embedding(ids, rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, torch.Tensor, None]:
        (ids,) = ctx.saved_tensors
        vocab, dim = ctx.rows_shape
        into = ctx.accumulated()
        if into is None:
            # autograd's own backward of F.embedding, handed to AccumulateGrad to keep as .grad
            whole = torch.ops.aten.embedding_dense_backward(grad, ids, vocab, -1, False)
            return None, whole, None
        distinct, where = torch.unique(ids, return_inverse=True)
        # autograd's own backward over the distinct ids alone: each row the same sum in the same order (`where` keeps
        # the ids' order), then added to its row of .grad, each row once (no two adds race on a GPU)
        sums = torch.ops.aten.embedding_dense_backward(grad, where, len(distinct), -1, False)
        into.index_add_(0, distinct, sums)
        return None, _no_memory_zero(into), None


class _Linear(torch.autograd.Function):
    """``x · rowsᵀ``; its backward adds the weight's gradient into the accumulated one a block of rows at a time."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, rows: torch.Tensor, accumulated: Accumulated) -> torch.Tensor:
        ctx.save_for_backward(x, rows)
        ctx.accumulated = accumulated
        return F.linear(x, rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, rows = ctx.saved_tensors
        out, dim = rows.shape
        flat_grad, flat_x = grad.reshape(-1, out), x.reshape(-1, dim)
        # the products autograd's backward of F.linear computes, in the same layout
        grad_x = flat_grad.mm(rows).view(x.shape) if ctx.needs_input_grad[0] else None
        if not ctx.needs_input_grad[1]:
            return grad_x, None, None
        into = ctx.accumulated()
        if into is None:
            return grad_x, flat_grad.t().mm(flat_x), None
        block = max(1, BLOCK_BYTES // (dim * rows.element_size()))
        for first in range(0, out, block):
            into[first : first + block].add_(flat_grad[:, first : first + block].t().mm(flat_x))
        return grad_x, _no_memory_zero(into), None
