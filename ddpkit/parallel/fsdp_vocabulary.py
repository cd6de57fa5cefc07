"""``parallel.fsdp.shard_vocabulary``: a language model's embedding and head split by vocabulary over fsdp2's ranks.

    ignored = shard_vocabulary(model, mesh)                     # before fully_shard: on meta, or built
    fully_shard(model, mesh=mesh, ignored_params=ignored)       # FSDP2 leaves the vocabulary rows alone
    with whole_vocabulary(model):                               # forwards that must not be collectives
        ...

Why: FSDP2 gathers a unit whole and makes its whole gradient in one op. At the vocabulary matrices, a language
model's largest tensors (``[vocab, dim]``: 125 MiB each in a 946 MiB Llama), a rank holds the gathered head beside
its new gradient in the head's backward, then that gradient beside the reduce-scatter's input: two whole matrices,
which do not shrink with N (13% of a two-rank share at that shape). Here each rank keeps ``vocab / N`` rows for good
(``Shard(0)`` on the data-parallel mesh, the layout FSDP2 stores them in, so checkpoints do not change) and the
ranks move activations instead of weights:

- **the embedding**: the ranks' token ids are all-gathered; each rank looks up every rank's ids in its own rows,
  zeros for the rest (Megatron-LM's masked lookup), and a reduce-scatter hands each rank the sum for its own tokens:
  the lookup of the whole matrix, bit for bit. Its backward all-gathers the output's gradient and makes the
  ``[vocab / N, dim]`` gradient of the rank's rows;
- **the head**: the ranks' final hidden states are all-gathered (``tokens x dim`` each), each rank scores every
  rank's tokens against its rows, and an all-to-all hands each rank its own tokens' logits over the whole
  vocabulary. The loss reads plain logits, as from a head never split, so a ``training_step`` needs no change (unlike
  ``loss_parallel``, whose logits stay split). The backward reverses the all-to-all, makes the ``[vocab / N, dim]``
  gradient, and reduce-scatters the hidden states' gradient, summed over the vocabulary shards.

A rank's row gradient sums every rank's tokens while FSDP2 averages gradients over the ranks, so it is divided by N
in the backward, on the tokens' side of the product that makes it (``tokens x dim``, not the rows' ``vocab / N x
dim``), so that no second rows-sized gradient is made beside the first. The ranks' token counts may differ (a short
last batch, padding per batch): each forward first agrees the largest (one all-reduce of an integer, read on the
host) and pads to it.

What it costs: traffic that grows with the tokens instead of the vocabulary. Per micro-batch each rank sends about
``(N - 1) (4 T dim + 2 T vocab / N)`` elements for its T tokens where FSDP2 sends ``(N - 1) 5 vocab dim / N`` (the
head gathered in the forward and again in the backward, its gradient reduce-scattered, the embedding gathered and
its gradient reduce-scattered): less while T < 5 vocab dim / (4 N dim + 2 vocab), about 2,300 tokens for a 32,000 x
1,024 vocabulary on 2 ranks, 2,000 for Llama 3 8B's on 64. On Gloo DTensor runs the all-to-all as an all-gather
(N times the logits' bytes, for a moment); NCCL has an all-to-all. So it is for runs short of memory, not a default.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement

from ddpkit.errors import ConfigError
from ddpkit.models.vocab_embedding import lookup_own_rows

__all__ = ["shard_vocabulary", "whole_vocabulary"]

#: Set on a module split here; under :func:`whole_vocabulary`, its whole matrix.
_SPLIT = "_ddpkit_vocabulary_rows"
_WHOLE = "_ddpkit_whole_vocabulary"


def shard_vocabulary(model: nn.Module, mesh: DeviceMesh) -> set[nn.Parameter]:
    """Split ``model.embed`` and ``model.head`` (ddpkit's GPT and Llama) by vocabulary rows over the 1-D ``mesh``, in
    place; their parameters, which ``fully_shard`` must then ignore."""
    embed, head = _vocabulary_modules(model, mesh.size())
    tied = head.weight is embed.weight
    _split_rows(embed, mesh)
    if tied:
        # one parameter read by two modules stays one
        head.register_parameter("weight", embed.weight)
    else:
        _split_rows(head, mesh)

    # functions, not functools.partial: a bound function survives a deep copy and torch.compile traces it
    def lookup(module: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        return _lookup(module, ids, mesh=mesh)

    def score(module: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
        return _score(module, hidden, mesh=mesh)

    embed.forward = types.MethodType(lookup, embed)
    head.forward = types.MethodType(score, head)
    for module in (embed, head):
        setattr(module, _SPLIT, True)
    return {embed.weight, head.weight}


@contextlib.contextmanager
def whole_vocabulary(model: nn.Module) -> Iterator[None]:
    """The split modules computing from their whole matrices, each gathered once here (a collective, the same order
    on every rank), so that no forward inside is one: validation when the ranks run unequal numbers of forwards."""
    split = [m for m in model.modules() if getattr(m, _SPLIT, False)]
    gathered: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for module in split:
            weight = module.weight
            if id(weight) not in gathered:
                gathered[id(weight)] = weight.full_tensor()
            setattr(module, _WHOLE, gathered[id(weight)])
    try:
        yield
    finally:
        for module in split:
            delattr(module, _WHOLE)


def _vocabulary_modules(model: nn.Module, ranks: int) -> tuple[nn.Embedding, nn.Linear]:
    """The model's token embedding and output head, or a clear error naming what is missing and the fix."""
    embed, head = getattr(model, "embed", None), getattr(model, "head", None)
    off = "or set parallel.fsdp.shard_vocabulary=false"
    if not (isinstance(embed, nn.Embedding) and isinstance(head, nn.Linear)):
        raise ConfigError(
            "parallel.fsdp.shard_vocabulary: splits a language model's token embedding `embed` (an nn.Embedding) and "
            f"output head `head` (an nn.Linear), as ddpkit's GPT and Llama name them; a {type(model).__name__} has no "
            f"such pair; {off}"
        )
    if head.bias is not None or embed.padding_idx is not None or embed.max_norm is not None:
        raise ConfigError(
            "parallel.fsdp.shard_vocabulary: takes a head without a bias and an embedding without padding_idx or "
            f"max_norm (ddpkit's models use none); {off}"
        )
    vocab = embed.num_embeddings
    if head.out_features != vocab:
        raise ConfigError(
            f"parallel.fsdp.shard_vocabulary: the head scores {head.out_features} ids and the embedding holds {vocab}; "
            f"they must be one vocabulary; {off}"
        )
    if vocab % ranks:
        raise ConfigError(
            f"parallel.fsdp.shard_vocabulary: a vocabulary of {vocab} rows does not split evenly over {ranks} "
            f"data-parallel ranks; pad it to a multiple of {ranks} (model.kwargs.vocab_size, the real size as "
            f"valid_vocab), {off}"
        )
    return embed, head


def _split_rows(module: nn.Module, mesh: DeviceMesh) -> None:
    """``module.weight`` as ``Shard(0)`` over ``mesh``: each rank keeps ``vocab / N`` consecutive rows."""
    weight = module.weight
    rows = distribute_tensor(weight.data, mesh, [Shard(0)])
    module.register_parameter("weight", nn.Parameter(rows, requires_grad=weight.requires_grad))


def _lookup(module: nn.Embedding, ids: torch.Tensor, *, mesh: DeviceMesh) -> torch.Tensor:
    """The embeddings of this rank's ``ids``, looked up where their rows live."""
    whole = getattr(module, _WHOLE, None)
    if whole is not None:
        return F.embedding(ids, whole)
    count = ids.numel()
    every = _every_ranks(ids.reshape(-1), mesh)
    rows = module.weight.to_local()
    own = lookup_own_rows(rows, every, first=mesh.get_local_rank() * rows.shape[0])
    # divided here, on every rank's tokens' gradients (tokens x dim), not on the rows' gradient: the embedding's
    # backward runs last, beside every other gradient, where a second [vocab / N, dim] tensor would set the peak
    own = _DividedGradient.apply(own, mesh.size())
    summed = DTensor.from_local(own, mesh, (Partial(),), run_check=False)
    mine = summed.redistribute(placements=(Shard(0),)).to_local()
    return mine[:count].reshape(*ids.shape, rows.shape[1])


def _score(module: nn.Linear, hidden: torch.Tensor, *, mesh: DeviceMesh) -> torch.Tensor:
    """The logits of this rank's tokens over the whole vocabulary, each rank scoring against its own rows."""
    whole = getattr(module, _WHOLE, None)
    if whole is not None:
        return F.linear(hidden, whole.to(hidden.dtype))
    lead, width = hidden.shape[:-1], hidden.shape[-1]
    flat = hidden.reshape(-1, width)
    count = flat.shape[0]
    # each vocabulary shard adds its part to these states' gradient: summed and scattered back to their ranks
    every = _every_ranks(flat, mesh, grad_placement=Partial())
    scores = _Scores.apply(every, module.weight.to_local(), mesh.size())
    scores = DTensor.from_local(scores, mesh, (Shard(1),), run_check=False)
    mine = scores.redistribute(placements=(Shard(0),)).to_local()
    return mine[:count].reshape(*lead, mine.shape[-1])


def _every_ranks(mine: torch.Tensor, mesh: DeviceMesh, *, grad_placement: Placement | None = None) -> torch.Tensor:
    """Every rank's tokens (``mine``: this rank's, along dim 0), rank by rank, each padded to the largest rank's
    count (agreed first: one all-reduce of an integer, read on the host), as the collectives need equal pieces.

    ``grad_placement``: what the result's gradient is (``Partial()``: a part of a sum, reduce-scattered back to
    the ranks; None: the same on every rank, each keeping its own piece)."""
    count = mine.shape[0]
    most = torch.tensor([count], device=mine.device)
    torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX, group=mesh.get_group())
    padding = [0, 0] * (mine.dim() - 1) + [0, int(most.item()) - count]
    pieces = DTensor.from_local(F.pad(mine, padding), mesh, (Shard(0),), run_check=False)
    grad_placements = (grad_placement,) if grad_placement is not None else None
    return pieces.redistribute(placements=(Replicate(),)).to_local(grad_placements=grad_placements)


class _Scores(torch.autograd.Function):
    """``F.linear(states, rows)`` in the states' type, whose backward makes the rows' gradient divided by ``ranks``
    in the one matmul that makes it.

    The states are divided (``tokens x dim``) rather than the result (``vocab / N x dim``), so no second rows-sized
    tensor is made beside the first (in a second micro-batch, beside every gradient). Under bf16 (the states come
    from FSDP2's units in it) that matmul runs in the rows' fp32: it sums every rank's tokens, the sum FSDP2 would
    reduce in fp32."""

    @staticmethod
    def forward(ctx: Any, states: torch.Tensor, rows: torch.Tensor, ranks: int) -> torch.Tensor:
        ctx.save_for_backward(states, rows)
        ctx.ranks = ranks
        return F.linear(states, rows.to(states.dtype))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        states, rows = ctx.saved_tensors
        summed = grad.t().to(rows.dtype) @ (states.to(rows.dtype) / ctx.ranks)
        return grad @ rows.to(grad.dtype), summed, None


class _DividedGradient(torch.autograd.Function):
    """The identity forward; the gradient divided by ``ranks`` (a sum over every rank's tokens made FSDP2's mean).
    For ``ranks`` a power of two the same bits wherever it is applied."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, ranks: int) -> torch.Tensor:
        ctx.ranks = ranks
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad / ctx.ranks, None
