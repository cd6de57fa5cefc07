"""A token embedding sharded by vocabulary rows whose backward computes only the rows each rank holds.

    plan["embed"] = VocabParallelEmbedding(output_layout=Replicate())   # or Shard(1) under sequence parallelism

Each tensor rank holds ``vocab / T`` consecutive rows of the ``[vocab, dim]`` matrix (``Shard(0)``, as torch's
``RowwiseParallel`` lays out an ``nn.Embedding``). The lookup is Megatron-LM's ``VocabParallelEmbedding``: each rank
looks up the ids that fall in its rows, writes zeros for the others, and the ranks' outputs are summed (an
all-reduce, or a reduce-scatter to each rank's slice of the sequence). Every position has exactly one non-zero
term, so the sum is the world of one's lookup, bit for bit.

Why not torch's ``RowwiseParallel``: its forward is this same masked lookup (DTensor's ``_MaskPartial``), but
DTensor has no sharding rule for the embedding's backward with the rows sharded and the ids replicated. The
backward then runs on replicated tensors and makes the gradient of the **whole** vocabulary matrix on every tensor
rank, ``T`` times the rank's share (125 MiB a rank for a 946 MiB Llama under tp2), at the backward's peak. Here the
lookup runs on the rank's own rows as plain tensors (``to_local``), so autograd's embedding backward makes a
``[vocab / T, dim]`` gradient, handed back as the parameter's ``Shard(0)``: the same values, a T-th of the bytes.

The style sets the module's ``forward`` to a function bound to it that calls :func:`_lookup_own_rows` (bound, so a
deep copy of the module keeps it); the parameter keeps its name and placement, so checkpoints, a tied head
(``ColwiseParallel`` on the same rows) and initialisation by name are unchanged. It takes an ``nn.Embedding`` with
no ``padding_idx`` or ``max_norm`` (ddpkit's models use neither) and a vocabulary that divides by ``T`` (the plan's
checks refuse others).
"""

from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import Placement

from ddpkit.models.accumulate_in_place import Accumulated, embedding, grad_of

__all__ = ["VocabParallelEmbedding", "lookup_own_rows"]


class VocabParallelEmbedding(ParallelStyle):
    """An ``nn.Embedding``'s rows split over the tensor ranks; its output summed into ``output_layout``
    (``Replicate()``: an all-reduce; ``Shard(1)``: a reduce-scatter, each rank keeping its slice of the sequence).
    The output is handed back as a local tensor, as ``RowwiseParallel``'s is by default."""

    def __init__(self, *, output_layout: Placement, in_place: bool = True):
        super().__init__()
        self.output_layout = output_layout
        #: Whether the backward adds into the parameter's ``.grad`` in place (False for a tied head's matrix).
        self.in_place = in_place

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Embedding) or module.padding_idx is not None or module.max_norm is not None:
            raise ValueError(
                f"VocabParallelEmbedding: takes an nn.Embedding without padding_idx or max_norm, got {module!r}; "
                "use torch's RowwiseParallel for it"
            )
        rows, tensor = module.num_embeddings, device_mesh.size()
        if rows % tensor:
            raise ValueError(
                f"VocabParallelEmbedding: a vocabulary of {rows} rows does not split evenly over {tensor} tensor "
                "ranks; pad the vocabulary to a multiple of the tensor degree, or keep the embedding replicated"
            )
        distribute_module(module, device_mesh, partition_fn=functools.partial(_rows, self.src_data_rank))
        output_layout, in_place = self.output_layout, self.in_place

        # a function, not a functools.partial: torch.compile traces a bound function, and reads its __name__
        def forward(embedding: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
            return _lookup_own_rows(embedding, ids, mesh=device_mesh, output_layout=output_layout, in_place=in_place)

        module.forward = types.MethodType(forward, module)
        return module

    def __repr__(self) -> str:
        return f"VocabParallelEmbedding(output_layout={self.output_layout!r}, in_place={self.in_place})"


def _rows(src_data_rank: int | None, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    """The embedding's weight as ``Shard(0)``: each rank keeps ``vocab / T`` consecutive rows."""
    weight = module.weight
    if not isinstance(weight, DTensor):
        shard = distribute_tensor(weight.data, mesh, [Shard(0)], src_data_rank=src_data_rank)
        module.register_parameter("weight", nn.Parameter(shard, requires_grad=weight.requires_grad))


def _lookup_own_rows(
    module: nn.Embedding, ids: torch.Tensor, *, mesh: DeviceMesh, output_layout: Placement, in_place: bool
) -> torch.Tensor:
    """The ids' embeddings from this rank's rows, zeros for the rest, summed over the tensor ranks."""
    local = module.weight.to_local()
    ids = ids.to_local() if isinstance(ids, DTensor) else ids
    first = mesh.get_local_rank() * local.shape[0]
    # the micro-batches' gradients of the rows are added into the parameter's local shard in place
    accumulated = grad_of(module.weight) if in_place else None
    own = lookup_own_rows(local, ids, first=first, accumulated=accumulated)
    summed = DTensor.from_local(own, mesh, (Partial(),), run_check=False)
    return summed.redistribute(placements=(output_layout,)).to_local()


def lookup_own_rows(
    rows: torch.Tensor, ids: torch.Tensor, *, first: int, accumulated: Accumulated | None = None
) -> torch.Tensor:
    """The embeddings of ``ids`` found in ``rows`` (the matrix's rows ``first`` onwards), zeros for the others.

    Summed over the ranks that hold the other rows, every position has exactly one non-zero term: the lookup of a
    whole matrix, bit for bit. The backward makes a gradient of ``rows``' shape only; with ``accumulated`` (where
    the rows' gradient accumulates) it adds into that in place once it exists
    (:mod:`ddpkit.models.accumulate_in_place`)."""
    elsewhere = (ids < first) | (ids >= first + rows.shape[0])
    # an id held elsewhere looks up row 0 and is zeroed, so its gradient (zero) lands in a row this rank holds
    local_ids = (ids - first).masked_fill(elsewhere, 0)
    own = F.embedding(local_ids, rows) if accumulated is None else embedding(local_ids, rows, accumulated)
    return own.masked_fill(elsewhere.unsqueeze(-1), 0.0)
