"""The tensor plans of ddpkit's own models, each family's own (``GPT.tensor_plan``, ``Llama.tensor_plan``).

    plan = model.tensor_plan(vocab_parallel=False)   # {"blocks.0.attn.q_proj": ColwiseParallel(), ...}

A plan is torch's own vocabulary (``torch.distributed.tensor.parallel``): ParallelStyle objects by module name,
applied by :func:`ddpkit.parallel.tensor_plan.apply_tensor_parallel` (``parallelize_module``, as torchtitan does);
that module's docstring has the table of what each style does and what a step costs. Here live the plans and the
one style of ddpkit's own they use, :class:`Replicated`. Imported only when a model is split: DTensor's parallel
styles are a second's import that runs without tensor parallelism never pay.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.distributed.tensor.placement_types import Placement

from ddpkit.errors import ConfigError
from ddpkit.models.vocab_embedding import VocabParallelEmbedding
from ddpkit.models.vocab_head import VocabParallelHead

__all__ = ["Replicated", "SequenceSplit", "llama_plan", "gpt2_plan"]

#: Why GPT-2's plan has no sequence parallelism (ddpkit.parallel.tensor_plan refuses it before any group).
GPT2_NO_SEQUENCE_PARALLEL = (
    "GPT-2's plan keeps its fused attention whole on every rank (its residual stream replicated), so there is no "
    "sharded matmul pair around it to split the sequence between; use arch: llama, or set "
    "parallel.sequence_parallel=false"
)

# LlamaBlock calls its attention as attn(x, rope, cache, documents): only x becomes a DTensor.
_ATTENTION_INPUTS = 4


class Replicated(ParallelStyle):
    """A module computed whole on every tensor-parallel rank: its own parameters become ``Replicate()`` DTensors.

    Its tensor inputs are read as DTensors of ``input_layout`` (``Replicate()``: the same tensor on every rank;
    ``Shard(d)``: each rank holds slice ``d``, as a per-head norm after a colwise projection does) and its output
    is handed back as the local tensor. Nothing is communicated forward; in the backward a parameter whose
    gradient sums over a sharded input (a per-head norm's weight) is all-reduced by DTensor, a replicated input's
    gradient is already whole. torchtitan's ``NoParallel`` does the same for the same reason: every parameter on
    one mesh, for clipping and the fused optimizers. ``distribute_module`` replicates the module's buffers too
    (none in ddpkit's norms, embeddings and Linears; RoPE's tables sit in a module the plan leaves alone).
    """

    def __init__(
        self,
        *,
        input_layout: Placement | None = None,
        desired_input_layout: Placement | None = None,
        output_layout: Placement | None = None,
    ):
        super().__init__()
        self.input_layout = input_layout or Replicate()
        #: With sequence parallelism: the layout the module computes on (``Replicate()``: the head all-gathers the
        #: sequence-sharded stream), and the one its output is handed back in (``Shard(1)``: the embedding keeps
        #: its rank's slice of the sequence, no collective forward, an all-gather backward). None: as they come.
        self.desired_input_layout = desired_input_layout
        self.output_layout = output_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            partition_fn=_replicate_parameters,
            input_fn=self._inputs_as_dtensors,
            output_fn=self._outputs_as_local,
        )

    def _inputs_as_dtensors(self, module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        inputs = tuple(_as_dtensor(x, mesh, self.input_layout) for x in inputs)
        if self.desired_input_layout is None:
            return inputs
        return tuple(_laid_out(x, self.desired_input_layout) for x in inputs)

    def _outputs_as_local(self, module: nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
        if self.output_layout is not None:
            outputs = _laid_out(outputs, self.output_layout)
        return outputs.to_local() if isinstance(outputs, DTensor) else outputs

    def __repr__(self) -> str:
        layouts = (self.input_layout, self.desired_input_layout, self.output_layout)
        names = ("input_layout", "desired_input_layout", "output_layout")
        return f"Replicated({', '.join(f'{n}={p!r}' for n, p in zip(names, layouts) if p is not None)})"


def _laid_out(x: Any, layout: Placement) -> Any:
    if isinstance(x, DTensor) and x.placements != (layout,):
        return x.redistribute(placements=(layout,))
    return x


def _as_dtensor(x: Any, mesh: DeviceMesh, layout: Placement) -> Any:
    if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
        # run_check=False: the layout is the plan's promise; checking it would cost a collective per call
        return DTensor.from_local(x, mesh, (layout,), run_check=False)
    return x


def _replicate_parameters(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    """``Replicate()`` every parameter ``module`` owns itself (``distribute_module`` replicates its buffers)."""
    for key, param in list(module.named_parameters(recurse=False)):
        if not isinstance(param, DTensor):
            replicated = distribute_tensor(param.data, mesh, [Replicate()])
            module.register_parameter(key, nn.Parameter(replicated, requires_grad=param.requires_grad))


def _vocabulary(vocab_parallel: bool, sequence_parallel: bool = False, *, tied: bool) -> dict[str, ParallelStyle]:
    """The embedding and the head: replicated, or sharded by vocabulary rows (``vocab_parallel``).

    Sharded, the embedding's rows are split (:class:`~ddpkit.models.vocab_embedding.VocabParallelEmbedding`: each
    rank looks up the ids it holds, zeros elsewhere, one all-reduce; its backward makes only its rows' gradient)
    and so are the head's (ColwiseParallel: each rank scores its ids); the logits stay a DTensor sharded on the
    vocabulary, for ``loss_parallel``. Both shard the same ``[vocab, dim]`` rows, so a tied head stays one
    parameter. With ``sequence_parallel`` the embedding hands each rank its slice of the sequence (sharded: a
    reduce-scatter instead of the all-reduce; replicated: a slice, no collective) and the head all-gathers the
    sequence back before it scores. From the second micro-batch on, both add their rows' gradient into ``.grad`` in
    place (:mod:`ddpkit.models.accumulate_in_place`), unless ``tied``: one matrix used twice has autograd sum the two
    uses' gradients first, an order the in-place adds would change.
    """
    if not vocab_parallel and not sequence_parallel:
        # a tied head gets its own hooks and, once applied, embed's parameter again (apply_tensor_parallel)
        return {"embed": Replicated(), "head": Replicated()}
    if not vocab_parallel:
        head = Replicated(input_layout=Shard(1), desired_input_layout=Replicate())
        return {"embed": SequenceSplit(Replicated(output_layout=Shard(1))), "head": head}
    stream = Shard(1) if sequence_parallel else Replicate()
    # RowwiseParallel's lookup; its backward makes only the rank's rows' gradient (ddpkit.models.vocab_embedding)
    embed = VocabParallelEmbedding(output_layout=stream, in_place=not tied)
    return {
        "embed": SequenceSplit(embed) if sequence_parallel else embed,
        "head": VocabParallelHead(input_layout=stream, in_place=not tied),
    }


class SequenceSplit(ParallelStyle):
    """``style`` on the embedding under sequence parallelism, refusing a length the tensor ranks cannot split evenly.

    Each rank's slice of the sequence is read back as ``Shard(1)`` of a length ``T`` times its own
    (``DTensor.from_local``), so an uneven split would all-gather the wrong length. The check is a forward
    pre-hook on the token ids, before any collective."""

    def __init__(self, style: ParallelStyle):
        super().__init__()
        self.style = style

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = self.style._apply(module, device_mesh)
        module.register_forward_pre_hook(partial(_check_sequence_splits, device_mesh.size()))
        return module

    def __repr__(self) -> str:
        return f"SequenceSplit({self.style!r})"


def _check_sequence_splits(tensor: int, module: nn.Module, inputs: tuple[Any, ...]) -> None:
    length = inputs[0].shape[1]
    if length % tensor:
        raise ValueError(
            f"parallel.sequence_parallel: a batch of {length}-token sequences does not split evenly over {tensor} "
            f"tensor ranks; give the model sequences whose length divides by {tensor} (pad them, or choose the "
            "data's sequence length), or set parallel.sequence_parallel=false"
        )


def llama_plan(
    model: nn.Module, *, vocab_parallel: bool = False, sequence_parallel: bool = False
) -> dict[str, ParallelStyle]:
    """The Llama family's plan (the table in :mod:`ddpkit.parallel.tensor_plan`): q/k/v and gate/up colwise,
    o/down rowwise; ``model`` is a :class:`~ddpkit.models.llama.Llama`.

    ``sequence_parallel`` (Megatron-LM's sequence parallelism, torchtitan's plan): between the blocks' sharded
    matmuls the residual stream is split by sequence, ``Shard(1)``, each rank holding ``length / T`` positions; the
    norms (``SequenceParallel``) and the residual adds compute on that slice. Each attention and MLP all-gathers
    its input and reduce-scatters its output (``RowwiseParallel(output_layouts=Shard(1))``) where the plain plan
    all-reduces: the same bytes, and the activations between them a T-th.
    """
    norm = SequenceParallel if sequence_parallel else Replicated
    stream = Shard(1) if sequence_parallel else Replicate()
    vocabulary = _vocabulary(vocab_parallel, sequence_parallel, tied=model.head.weight is model.embed.weight)
    plan: dict[str, ParallelStyle] = {**vocabulary, "norm": norm()}
    rest = (None,) * (_ATTENTION_INPUTS - 1)
    # the whole sequence, replicated: what q/k/v and gate/up compute on
    whole = (Replicate(),) + rest
    # the dropouts on the residual stream run on DTensors, their masks drawn by DTensor's RNG tracker (CUDA)
    plan["drop"] = Replicated(input_layout=stream)
    for i, block in enumerate(model.blocks):
        prefix = f"blocks.{i}"
        plan[f"{prefix}.drop"] = Replicated(input_layout=stream)
        plan[f"{prefix}.attn_norm"] = norm()
        plan[f"{prefix}.mlp_norm"] = norm()
        plan[f"{prefix}.attn"] = PrepareModuleInput(
            input_layouts=(stream,) + rest, desired_input_layouts=whole, use_local_output=False
        )
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"{prefix}.attn.{name}"] = ColwiseParallel()
        plan[f"{prefix}.attn.o_proj"] = RowwiseParallel(output_layouts=stream)
        if block.attn.q_norm is not None:
            # q and k are [batch, length, heads, head_dim] there, each rank holding dim 2's slice
            plan[f"{prefix}.attn.q_norm"] = Replicated(input_layout=Shard(2))
            plan[f"{prefix}.attn.k_norm"] = Replicated(input_layout=Shard(2))
        plan[f"{prefix}.mlp"] = PrepareModuleInput(
            input_layouts=(stream,), desired_input_layouts=(Replicate(),), use_local_output=False
        )
        plan[f"{prefix}.mlp.gate_proj"] = ColwiseParallel()
        plan[f"{prefix}.mlp.up_proj"] = ColwiseParallel()
        plan[f"{prefix}.mlp.down_proj"] = RowwiseParallel(output_layouts=stream)
    return plan


def gpt2_plan(
    model: nn.Module, *, vocab_parallel: bool = False, sequence_parallel: bool = False
) -> dict[str, ParallelStyle]:
    """GPT-2's plan (``model``: a :class:`~ddpkit.models.gpt.GPT`): each block's MLP sharded (``fc`` colwise,
    ``proj`` rowwise), its fused attention replicated.

    A colwise split of the fused ``attn.qkv`` (rows ``[q | k | v]``) would give rank 0 all of q and part of k, not
    whole heads; splitting it by heads would need a strided placement torch keeps private (``_StridedShard``)
    and a checkpoint layout of its own, so the attention stays whole on every rank (see the module docstring).
    """
    if sequence_parallel:
        raise ConfigError(f"parallel.sequence_parallel: {GPT2_NO_SEQUENCE_PARALLEL}")
    # GPT's head is its embedding
    plan = {**_vocabulary(vocab_parallel, tied=True), "pos": Replicated(), "drop": Replicated(), "ln_f": Replicated()}
    for i in range(len(model.blocks)):
        prefix = f"blocks.{i}"
        # drop: the residual dropout on DTensors, one mask on every rank from DTensor's RNG tracker (CUDA)
        for name in ("ln1", "ln2", "attn.qkv", "attn.proj", "drop"):
            plan[f"{prefix}.{name}"] = Replicated()
        plan[f"{prefix}.fc"] = ColwiseParallel()
        plan[f"{prefix}.proj"] = RowwiseParallel()
    return plan
