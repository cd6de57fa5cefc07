"""The output head split by vocabulary rows over the tensor ranks, its rows' gradient added into ``.grad`` in place.

    plan["head"] = VocabParallelHead(input_layout=Replicate())   # or Shard(1) under sequence parallelism

torch's ``ColwiseParallel`` with the head's layouts (each tensor rank holds ``vocab / T`` rows, the logits stay a
DTensor sharded on the vocabulary for ``loss_parallel``), whose forward scores the rank's own rows as plain tensors
(``to_local``) through :func:`ddpkit.models.accumulate_in_place.linear`. So from the second micro-batch on, the
backward adds the rows' gradient into the parameter's shard in place instead of making a second
``[vocab / T, dim]`` matrix beside it (62.5 MiB a rank at a 32,000 x 1,024 vocabulary under tp2; the peak of
tp2's backward and of pp2 x tp2's last stage). The same products as DTensor's, so the same bits.

The input's gradient is each rank's part of a sum over the vocabulary (``Partial``), reduced into the input's layout
by the input's own redistribution, as DTensor's backward does. A head whose matrix is also the embedding's (tied)
keeps ``ColwiseParallel``'s forward: autograd adds the two uses' gradients before ``.grad``, another order.
"""

from __future__ import annotations

import types

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Shard
from torch.distributed.tensor.parallel import ColwiseParallel
from torch.distributed.tensor.placement_types import Placement

from ddpkit.models.accumulate_in_place import grad_of, linear

__all__ = ["VocabParallelHead"]


class VocabParallelHead(ColwiseParallel):
    """``ColwiseParallel(input_layouts=input_layout, output_layouts=Shard(-1), use_local_output=False)`` on a
    bias-free ``nn.Linear``, accumulating its rows' gradient in place (``in_place``: False for a tied head)."""

    def __init__(self, *, input_layout: Placement, in_place: bool = True):
        super().__init__(input_layouts=input_layout, output_layouts=Shard(-1), use_local_output=False)
        self.in_place = in_place

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        if self.in_place and isinstance(module, nn.Linear) and module.bias is None:
            # a function, not a functools.partial: torch.compile traces a bound function, and reads its __name__
            def forward(head: nn.Linear, x: DTensor) -> DTensor:
                return _score_own_rows(head, x, mesh=device_mesh)

            module.forward = types.MethodType(forward, module)
        return module

    def __repr__(self) -> str:
        return f"VocabParallelHead(input_layout={self.input_layouts[0]!r}, in_place={self.in_place})"


def _score_own_rows(head: nn.Linear, x: DTensor, *, mesh: DeviceMesh) -> DTensor:
    """The logits of the rank's own vocabulary rows, as the vocabulary-sharded DTensor ``ColwiseParallel`` gives."""
    # each rank's input gradient is its rows' part of a sum over the vocabulary: Partial, reduced by x's producer
    scores = linear(x.to_local(grad_placements=(Partial(),)), head.weight.to_local(), grad_of(head.weight))
    return DTensor.from_local(scores, mesh, (Shard(scores.dim() - 1),), run_check=False)
