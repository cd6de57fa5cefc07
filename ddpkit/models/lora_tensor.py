"""LoRA's adapters under a tensor plan: each :class:`~ddpkit.models.lora.LoraLinear` split as its base layer is.

    plan = lora_plan(model, plan)     # a LoraLinear's ColwiseParallel / RowwiseParallel becomes LoraParallel(it)

A plan names the base layers (``blocks.0.attn.q_proj: ColwiseParallel()``); after ``model.lora`` those modules are
:class:`LoraLinear`, whose output is ``x W^T + b + s * B(A(x))``. torch's styles cannot split one: they would
shard every parameter under the module alike, the adapter's too. :class:`LoraParallel` splits the base as its style
says and the adapter so that its update lands in the same layout as the base's output, with no collective of its
own in the forward (peft's layers under Megatron-LM's tensor parallelism split them the same way):

=====================  ===============================  ===============================  =========================
base style             base ``W [out, in]``             ``A [r, in]``                    ``B [out, r]``
=====================  ===============================  ===============================  =========================
ColwiseParallel        ``Shard(0)``: ``out / T`` rows   ``Replicate()``: reads the       ``Shard(0)``: its output
                                                        whole, replicated ``x``          is the base's ``Shard(-1)``
RowwiseParallel        ``Shard(1)``: ``in / T`` columns ``Shard(1)``: reads the rank's   ``Replicate()``: ``B``
                                                        slice of ``x``, a partial sum    maps the partial sum on,
                                                                                         reduced with the base's
=====================  ===============================  ===============================  =========================

Rowwise, ``A x`` is a partial sum like ``W x`` and ``B`` is linear, so the two partial outputs add up and the
base's one all-reduce (or reduce-scatter, with sequence parallelism) reduces both. The backward costs one more
all-reduce per adapter, of an ``r``-wide gradient: colwise, ``A``'s gradient sums over the output columns each rank
holds; rowwise, ``B``'s sums over the input columns (:func:`ddpkit.parallel.tensor_plan.apply_tensor_parallel`
reduces a ``Partial`` gradient once). A module under :class:`~ddpkit.models.tensor_plans.Replicated` (GPT-2's
fused attention) needs nothing: the adapter is replicated with its base.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.distributed.tensor.placement_types import Placement

from ddpkit.errors import ConfigError
from ddpkit.models.lora import LoraLinear
from ddpkit.models.tensor_plans import Replicated

__all__ = ["LoraParallel", "lora_plan"]

# Each parameter of a LoraLinear, by its name under the layer, and where it goes: the table above.
_COLWISE = {"weight": Shard(0), "bias": Shard(0), "lora_A.weight": Replicate(), "lora_B.weight": Shard(0)}
_ROWWISE = {"weight": Shard(1), "bias": Replicate(), "lora_A.weight": Shard(1), "lora_B.weight": Replicate()}


class LoraParallel(ParallelStyle):
    """A :class:`LoraLinear` split as ``base`` (its base layer's ColwiseParallel or RowwiseParallel) says, the
    adapter with it (the module docstring's table); the inputs and outputs laid out as ``base`` lays them out."""

    def __init__(self, base: ColwiseParallel | RowwiseParallel):
        super().__init__()
        self.base = base
        self.colwise = isinstance(base, ColwiseParallel)
        self.src_data_rank = base.src_data_rank

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, LoraLinear):
            raise TypeError(f"LoraParallel splits a LoraLinear, got a {type(module).__name__}")
        layouts = _COLWISE if self.colwise else _ROWWISE
        # a colwise layer computes on the whole input, a rowwise one on each rank's slice of its last dimension
        desired = (Replicate(),) if self.colwise else (Shard(-1),)
        base = self.base
        return distribute_module(
            module,
            device_mesh,
            partial(self._partition, layouts),
            partial(base._prepare_input_fn, base.input_layouts, desired),
            partial(base._prepare_output_fn, base.output_layouts, base.use_local_output),
        )

    def _partition(self, layouts: dict[str, Placement], name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        # called for the layer ("") and each submodule (lora_A, lora_B, lora_dropout) with its own parameters
        for key, param in list(module.named_parameters(recurse=False)):
            placement = layouts[f"{name}.{key}" if name else key]
            shard = distribute_tensor(param.data, mesh, [placement], src_data_rank=self.src_data_rank)
            module.register_parameter(key, nn.Parameter(shard, requires_grad=param.requires_grad))

    def __repr__(self) -> str:
        return f"LoraParallel({self.base!r})"


def lora_plan(model: nn.Module, plan: Mapping[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """``plan`` with the style of every :class:`LoraLinear` it names made :class:`LoraParallel` of it; a plan without
    adapters unchanged. A style ddpkit cannot split an adapter by is refused, naming the module."""
    adapted = dict(plan)
    for name, style in plan.items():
        try:
            module = model.get_submodule(name) if name else model
        except AttributeError:
            # a pattern (``blocks.*.attn``): torch matches it; an adapter's layer is named by its full name
            continue
        if not isinstance(module, LoraLinear) or isinstance(style, (Replicated, LoraParallel)):
            continue
        if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
            raise ConfigError(
                f"model.lora: the tensor plan gives the adapted layer {name} a {type(style).__name__}, and only "
                "ColwiseParallel, RowwiseParallel and Replicated split an adapter with its base; give it one of "
                "those, or leave it out of model.lora.targets"
            )
        adapted[name] = LoraParallel(style)
    return adapted
