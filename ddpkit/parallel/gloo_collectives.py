"""FSDP2's all-gather and reduce-scatter on Gloo without Gloo's staging copies: a whole unit's bytes less at the peak.

    from ddpkit.parallel.gloo_collectives import use_in_place_collectives
    use_in_place_collectives(unit, runtime.backend)     # each fully_shard-ed unit; does something under Gloo

Gloo (the CPU backend) implements ``reduce_scatter_tensor`` by copying the whole input into a buffer of its own,
all-reducing that and keeping one chunk, and ``all_gather_into_tensor`` by gathering into a whole-sized buffer of its
own and copying out. Measured on 2 ranks, a 128 MiB input: each holds 128 MiB more than its input and output
while it runs; an in-place ``all_reduce`` 2 MiB, a ``broadcast`` nothing. Under fsdp2 that staging copy lands where a
rank's training peak is, at the output head's backward: the head's gradient, its reduce-scatter input and Gloo's
copy of it (measured on a 946 MiB Llama: see docs/modes.md's steady-state table).

FSDP2 lets a unit's two collectives be replaced (``set_custom_reduce_scatter``, ``set_custom_all_gather``: public
methods of every ``fully_shard``-ed module) by any object with ``allocate(size, *, dtype, device)`` and a call taking
FSDP2's keywords. The two here:

- :class:`InPlaceReduceScatter`: ``all_reduce`` of FSDP2's reduce-scatter input in place, then this rank's chunk
  copied out. Gloo's own reduce-scatter is that same all-reduce on its copy, so the sums are bitwise the same
  (checked on 2 and 3 ranks, SUM and AVG, in tests/test_fsdp_memory.py). The input is freed as the call ends:
  FSDP2 keeps it until the next unit's post-backward, for a GPU's reduce-scatter stream, which on the CPU kept a
  dead unit-sized buffer through the next block's backward (measured: 44 MiB less at the peak of fsdp2 on a 946 MiB
  Llama with the vocabulary split, whose peak is in the blocks' backward).
- :class:`BroadcastAllGather`: FSDP2 has already copied this rank's shard into its slot of the output; each rank's
  slot is then broadcast from that rank, in place. No arithmetic, so the bytes are exact; the same bytes cross the
  wire as Gloo's ring all-gather, in ``world size`` collectives instead of one.

Both are synchronous (Gloo's collectives here block the calling thread anyway) and return None, which FSDP2 reads as
nothing to wait for. NCCL needs none of this: its collectives write into the given output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["BroadcastAllGather", "InPlaceReduceScatter", "use_in_place_collectives"]


class _Allocates:
    """FSDP2's comm interface's allocation: a plain ``torch.empty`` (FSDP2's own default)."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class InPlaceReduceScatter(_Allocates):
    """A reduce-scatter as an in-place ``all_reduce`` of the input, then this rank's chunk copied to the output."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> None:
        # FSDP2 builds the input for this call alone and drops it afterwards: overwriting it is safe.
        dist.all_reduce(input_tensor, op=op, group=group)
        chunks = input_tensor.view(group.size(), -1)
        output_tensor.view(-1).copy_(chunks[group.rank()])
        # Freed now, not when FSDP2 drops it: FSDP2 keeps each reduce-scatter's input alive until the next unit's
        # post-backward (for a GPU's reduce-scatter stream), which on the CPU holds a dead unit-sized buffer through
        # the next block's whole backward, where the peak is. This call has finished with it and nothing reads it.
        input_tensor.untyped_storage().resize_(0)
        return None


class BroadcastAllGather(_Allocates):
    """An all-gather as one in-place ``broadcast`` per rank, each of that rank's slot of the output."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> None:
        slots = output_tensor.view(group.size(), -1)
        mine = slots[group.rank()]
        # FSDP2's copy-in makes the input a view of this rank's slot; anything else is copied there first.
        if mine.data_ptr() != input_tensor.data_ptr():
            mine.copy_(input_tensor.view(-1))
        for source, slot in enumerate(slots):
            dist.broadcast(slot, group=group, group_src=source)
        return None


def use_in_place_collectives(unit: nn.Module, backend: str) -> bool:
    """Give a ``fully_shard``-ed ``unit`` the two collectives above when the run's ``backend`` is Gloo; whether it
    did."""
    if backend != "gloo":
        return False
    unit.set_custom_reduce_scatter(InPlaceReduceScatter())
    unit.set_custom_all_gather(BroadcastAllGather())
    return True
