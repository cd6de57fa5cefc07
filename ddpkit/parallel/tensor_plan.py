"""Tensor parallelism for ddpkit's own models: their tensor plans, the checks, and the plan applied with DTensor.

    mesh = init_device_mesh("cpu", (2,))                    # a 1-D mesh of the tensor-parallel ranks (Gloo here)
    check_tensor_plan(model, 2)                             # heads, kv heads, MLP width divisible; no dropout
    plan = tensor_plan(model)                               # {"blocks.0.attn.q_proj": ColwiseParallel(), ...}
    apply_tensor_parallel(model, mesh, plan)                # in place: every parameter is now a DTensor
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())   # the logits are a plain, whole tensor

A plan is torch's own vocabulary (``torch.distributed.tensor.parallel``): ParallelStyle objects by module name,
applied by ``parallelize_module`` as torchtitan does. Megatron-LM's split of a transformer block, per block:

================================  ===========================================================================
``attn`` (PrepareModuleInput)     its input becomes one replicated DTensor, so q/k/v share one gradient
                                  all-reduce in the backward instead of one each
``attn.q_proj/k_proj/v_proj``     ColwiseParallel: each rank computes ``heads / T`` query heads and
                                  ``kv_heads / T`` key/value heads, whole heads (the rows of a head are adjacent)
``attn.o_proj``                   RowwiseParallel: each rank's heads times its columns, summed (an all-reduce)
``mlp`` (PrepareModuleInput)      as ``attn``: one gradient all-reduce for gate_proj and up_proj
``mlp.gate_proj/up_proj``         ColwiseParallel: ``mlp_dim / T`` of the SwiGLU's width on each rank
``mlp.down_proj``                 RowwiseParallel: the partial outputs summed (an all-reduce)
``attn.q_norm/k_norm`` (Qwen3)    :class:`Replicated` over a head-sharded input: their weight's gradient, a
                                  sum over every head, is all-reduced
``embed`` / ``head``              :class:`Replicated`, or with ``vocab_parallel`` sharded by vocabulary rows
                                  (:class:`~ddpkit.models.vocab_embedding.VocabParallelEmbedding`, whose
                                  backward makes only the rank's rows / ColwiseParallel), the logits a
                                  vocabulary-sharded DTensor
``drop`` (residual dropouts)      :class:`Replicated` over the stream's layout: their masks DTensor ops
everything else                   :class:`Replicated`: position embeddings and norms whole on every rank
================================  ===========================================================================

With ``sequence_parallel`` (the Llama family) the residual stream between the sharded pairs is split by
sequence, ``Shard(1)``: the norms are torch's ``SequenceParallel``, ``attn`` and ``mlp`` all-gather their input,
``o_proj`` and ``down_proj`` reduce-scatter instead of all-reducing, the embedding hands each rank its slice and
the head all-gathers it back (torchtitan's Llama plan; :func:`~ddpkit.models.tensor_plans.llama_plan`). A LoRA
model's adapted layers split with their adapters (:mod:`ddpkit.models.lora_tensor`).

The heads each rank holds need no setting: :class:`~ddpkit.models.llama.LlamaAttention` reads its head count
off the projection (``view(batch, length, -1, head_dim)``), so a rank with ``heads / T`` heads' rows gets
``heads / T`` heads. Grouped-query attention keeps its grouping: a rank's ``heads / T`` query heads are whole
groups of ``heads / kv_heads``, each reading one of the rank's own ``kv_heads / T`` key/value heads, the one the
whole model's query head ``h`` reads (``h // (heads / kv_heads)``). The KV cache (generation) is built for the
whole model's ``kv_heads``, so a tensor-parallel model does not generate. The plan goes on the bare model, before
activation checkpointing, compile and FSDP2 (torchtitan's order): a checkpoint wrapper renames the blocks' modules.

One step costs, under T > 1, four all-reduces per block (two forward, two backward; six with Qwen3's q/k norms)
with the vocabulary replicated (``vocab_parallel=False``): the logits come back whole and the loss is the usual
one. ``tensor_plan(model, vocab_parallel=True)`` shards the vocabulary as torchtitan does (five more all-reduces a
step: the embedding's lookup, the head's input gradient, three in ``loss_parallel``'s cross-entropy), and the loop
must then compute the loss and call backward inside ``with loss_parallel():``. A run does that by default where
the vocabulary divides by T (:func:`vocab_parallel_for`, ``parallel.vocab_parallel: null``): the embedding and
head are 13% of Llama 3 8B, and replicated they leave each of 8 tensor ranks about 24% of the model, not 12.5%.
Every parameter is a DTensor (the replicated ones ``Replicate()``), which is what ``clip_grad_norm_`` and the
optimizers' foreach kernels need: a model mixing DTensors and plain tensors fails there ("got mixed torch.Tensor
and DTensor").

GPT-2 (``arch: gpt2``) fuses q, k and v into one ``attn.qkv`` Linear whose rows are ``[q | k | v]``: a colwise
split of it hands rank 0 all of q and the first half of k (at T = 2), not whole heads, so its plan shards the MLP
only (``fc`` colwise, ``proj`` rowwise: 2/3 of a block's parameters) and replicates the attention. The Llama
family (``arch: llama``, separate q/k/v) shards both.

Dropout under T > 1 is refused on the CPU: there DTensor has no random ops (``OffsetBasedRNGTracker`` requires a
CUDA-like device, torch/distributed/tensor/_random.py; ``is_rng_supported_mesh`` is False), and the dropouts
would act on each rank's local shard, whose masks match neither each other nor a world of one. On CUDA the
residual dropouts run on DTensors (their plan entries) and DTensor's RNG tracker draws their masks, made here
without its first-use broadcast since a replica's tensor ranks share a seed (:func:`ddpkit.training.rng.rank_seed`);
GPT-2's (its attention is whole) and LoRA's adapters' dropouts run, the Llama family's stays refused: its attention
drops inside ``scaled_dot_product_attention`` on each rank's heads as plain tensors the tracker does not see.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from ddpkit.errors import ConfigError
from ddpkit.models.gpt import GPT, resolve
from ddpkit.models.init_by_name import tied_names
from ddpkit.models.llama import Llama, LlamaShape
from ddpkit.models.lora import LoraLinear
from ddpkit.models.lora_tensor import lora_plan
from ddpkit.models.tensor_plans import GPT2_NO_SEQUENCE_PARALLEL, Replicated

__all__ = [
    "Replicated",
    "tensor_plan",
    "check_tensor_plan",
    "tensor_problems",
    "valid_tensor_degrees",
    "vocab_parallel_for",
    "apply_tensor_parallel",
    "hook_gradients",
]

# What GPT-2's plan splits T-way (its attention is replicated: see gpt2_plan).
_GPT2_WIDTH = "the MLP width (4 x model.kwargs.dim)"
_LLAMA_NO_DROPOUT = (
    "the Llama family's attention applies it inside scaled_dot_product_attention to each rank's own heads, as "
    "plain tensors that DTensor's RNG tracker does not see, so the tensor ranks (one seed, ddpkit.training.rng) "
    "would draw one mask for each other's heads; set it to 0 or parallel.tensor: 1 (GPT-2, whose attention is "
    "whole on every rank, and model.lora.dropout run tensor-parallel on CUDA)"
)
_USER_NO_SEQUENCE_PARALLEL = (
    "ddpkit splits the sequence in its own models' plans; a user's plan lays out its own modules (torch's "
    "SequenceParallel for the norms, with the matmuls' input and output layouts to match), so set "
    "parallel.sequence_parallel=false and put those styles in the plan"
)


def tensor_plan(
    model: nn.Module, *, vocab_parallel: bool = False, sequence_parallel: bool = False
) -> dict[str, ParallelStyle]:
    """The tensor plan of one of ddpkit's own models (:class:`Llama`, :class:`GPT`: their ``tensor_plan``) by
    module name.

    ``vocab_parallel``: shard the embedding and the head by vocabulary too; the model then returns its logits as a
    DTensor sharded on the vocabulary, and the loss and its backward must run under torch's ``loss_parallel()``.
    ``sequence_parallel``: the residual stream between the blocks' matmuls split by sequence (the Llama family).
    A user's model brings its own plan (a dict of the same kind); ddpkit cannot guess which of its Linears pair up.
    """
    # Each of ddpkit's model families owns its plan (ddpkit.models.tensor_plans).
    own_plan = getattr(model, "tensor_plan", None)
    if callable(own_plan):
        # a user's model's tensor_plan need not know the option it does not use
        options = {"sequence_parallel": True} if sequence_parallel else {}
        return own_plan(vocab_parallel=vocab_parallel, **options)
    raise ConfigError(
        f"parallel.tensor: ddpkit has no tensor plan for a {type(model).__name__}; give one as torch's ParallelStyle "
        "objects by module name (ColwiseParallel for a pair's first Linear, RowwiseParallel for its second), e.g. "
        "by overriding the Trainer's tensor_plan(model), or set parallel.tensor: 1"
    )


class _Sizes(NamedTuple):
    """What a plan's degree must divide, and what else decides whether a model can run tensor-parallel."""

    #: What every plan splits T-way, by its config name: its size (empty: a user's model, its plan unknown).
    widths: dict[str, int]
    vocab_size: int | None
    #: The ids from here up are padding, their logits masked (None: none).
    valid_vocab: int | None
    dropout: float
    dropout_key: str
    #: A LoRA adapter's dropout (``model.lora.dropout``), applied to each adapted layer's input.
    lora_dropout: float = 0.0
    #: Why the model's plan cannot split its sequence (None: it can, the Llama family).
    no_sequence_parallel: str | None = None
    #: Why its dropout cannot run tensor-parallel even on CUDA (None: it can there).
    no_dropout: str | None = None


def _sizes(model_or_shape: Any) -> _Sizes:
    """The :class:`_Sizes` of a model, a :class:`LlamaShape` or the ``gpt`` builder's ``model.kwargs``."""
    key = "model.kwargs.dropout"
    if isinstance(model_or_shape, Mapping):
        arch, kwargs = resolve(dict(model_or_shape))
        if arch == "gpt2":
            padded = kwargs["valid_vocab"] if (kwargs["valid_vocab"] or 0) < kwargs["vocab_size"] else None
            sizes = _Sizes({_GPT2_WIDTH: 4 * kwargs["dim"]}, kwargs["vocab_size"], padded, kwargs["dropout"], key)
            return sizes._replace(no_sequence_parallel=GPT2_NO_SEQUENCE_PARALLEL)
        model_or_shape = LlamaShape(**kwargs)
    if isinstance(model_or_shape, Llama):
        return _sizes(model_or_shape.shape)._replace(lora_dropout=_dropouts(model_or_shape)[1])
    if isinstance(model_or_shape, LlamaShape):
        shape = model_or_shape
        widths = {"model.kwargs.heads": shape.heads, "model.kwargs.kv_heads": shape.kv_heads}
        widths["model.kwargs.mlp_dim"] = shape.mlp_dim
        padded = shape.valid_vocab if (shape.valid_vocab or 0) < shape.vocab_size else None
        return _Sizes(widths, shape.vocab_size, padded, shape.dropout, key, no_dropout=_LLAMA_NO_DROPOUT)
    if isinstance(model_or_shape, nn.Module):
        dropout, adapters = _dropouts(model_or_shape)
        if isinstance(model_or_shape, GPT):
            gpt = model_or_shape
            widths = {_GPT2_WIDTH: 4 * gpt.dim}
            return _Sizes(widths, gpt.vocab_size, gpt.valid_vocab, dropout, key, adapters, GPT2_NO_SEQUENCE_PARALLEL)
        # a user's model: its plan is its own; only its dropout can be judged from outside
        return _Sizes({}, None, None, dropout, "the model's nn.Dropout p", adapters, _USER_NO_SEQUENCE_PARALLEL)
    raise TypeError(f"check_tensor_plan: expected a model, a LlamaShape or gpt model.kwargs, got {model_or_shape!r}")


def _dropouts(model: nn.Module) -> tuple[float, float]:
    """The largest ``nn.Dropout`` p of ``model``'s own layers, and of its LoRA adapters' (``model.lora.dropout``)."""
    adapters = [m.lora_dropout for m in model.modules() if isinstance(m, LoraLinear)]
    own = [m.p for m in model.modules() if isinstance(m, nn.Dropout) and not any(m is a for a in adapters)]
    return max(own, default=0.0), max((a.p for a in adapters), default=0.0)


def _split_widths(sizes: _Sizes, vocab_parallel: bool) -> dict[str, int]:
    if vocab_parallel and sizes.vocab_size is not None:
        return {**sizes.widths, "model.kwargs.vocab_size": sizes.vocab_size}
    return sizes.widths


def vocab_parallel_for(model_or_shape: Any, tensor: int, setting: bool | None) -> bool:
    """Whether a run shards the vocabulary: ``parallel.vocab_parallel`` when set, and when null (the default) yes
    for ddpkit's own models whose vocabulary divides by ``tensor`` with no padded ids (padding could not be masked
    on a shard); never with ``tensor`` 1 or for a user's model, whose plan ddpkit does not know.

    ``model_or_shape``: as :func:`check_tensor_plan` takes it. ``true`` on a vocabulary that does not divide is
    refused by :func:`check_tensor_plan`, naming the valid degrees.
    """
    if setting is not None:
        return setting
    if tensor == 1:
        return False
    sizes = _sizes(model_or_shape)
    return sizes.vocab_size is not None and sizes.vocab_size % tensor == 0 and sizes.valid_vocab is None


def valid_tensor_degrees(model_or_shape: Any, *, vocab_parallel: bool = False) -> list[int] | None:
    """Every ``parallel.tensor`` the model's plan can split it by: the common divisors of the widths it shards
    (None for a user's model, whose plan ddpkit does not know)."""
    widths = _split_widths(_sizes(model_or_shape), vocab_parallel)
    if not widths:
        return None
    smallest = min(widths.values())
    return [t for t in range(1, smallest + 1) if all(size % t == 0 for size in widths.values())]


def tensor_problems(
    model_or_shape: Any,
    tensor: int,
    *,
    vocab_parallel: bool = False,
    sequence_parallel: bool = False,
    device: str = "cpu",
) -> list[str]:
    """What stops ``model_or_shape`` from running ``tensor``-way on ``device`` (its type: ``cpu``, ``cuda``), one
    sentence each (empty: it can)."""
    if tensor == 1:
        return []
    sizes = _sizes(model_or_shape)
    widths = _split_widths(sizes, vocab_parallel)
    problems = [f"{name} {size} is not divisible by {tensor}" for name, size in widths.items() if size % tensor]
    if vocab_parallel and sizes.valid_vocab is not None:
        problems.append(
            f"model.kwargs.valid_vocab {sizes.valid_vocab} pads the vocabulary, and DTensor cannot mask a sharded "
            "vocabulary's padded logits (aten.fill_ has no sharding strategy); keep the head replicated"
        )
    if sequence_parallel and sizes.no_sequence_parallel is not None:
        problems.append(f"parallel.sequence_parallel: {sizes.no_sequence_parallel}")
    dropouts = ((sizes.dropout_key, sizes.dropout, sizes.no_dropout), ("model.lora.dropout", sizes.lora_dropout, None))
    for key, p, on_cuda in dropouts:
        if p > 0 and device != "cuda":
            problems.append(
                f"{key} {p} cannot run tensor-parallel on the {device}: there DTensor has no random ops "
                "(torch.distributed.tensor._random: OffsetBasedRNGTracker needs a CUDA-like device) and the "
                "dropouts would act on each rank's shard, whose masks would match neither each other nor a world of "
                "one; set it to 0, parallel.tensor: 1, or run on GPUs (dist.device: cuda)"
            )
        elif p > 0 and on_cuda is not None:
            problems.append(f"{key} {p} cannot run tensor-parallel: {on_cuda}")
    return problems


def check_tensor_plan(
    model_or_shape: Any,
    tensor: int,
    *,
    vocab_parallel: bool = False,
    sequence_parallel: bool = False,
    device: str = "cpu",
) -> None:
    """Refuse a tensor degree the model cannot take, naming the valid ones (before any process group exists).

    ``model_or_shape``: a :class:`Llama` or :class:`GPT` (or a user's model: dropout only), a
    :class:`LlamaShape`, or the ``gpt`` builder's ``model.kwargs`` (resolved as the builder does);
    ``vocab_parallel``, ``sequence_parallel``: the plan shards the vocabulary, the sequence too (:func:`tensor_plan`);
    ``device``: the device type the
    run computes on (dropout runs tensor-parallel on ``cuda`` only).
    """
    if not isinstance(tensor, int) or isinstance(tensor, bool) or tensor < 1:
        raise ConfigError(f"parallel.tensor: expected a positive integer, got {tensor!r}")
    split = {"vocab_parallel": vocab_parallel, "sequence_parallel": sequence_parallel}
    problems = tensor_problems(model_or_shape, tensor, **split, device=device)
    if problems:
        valid = valid_tensor_degrees(model_or_shape, vocab_parallel=vocab_parallel)
        valid_text = "" if valid is None else f" (valid parallel.tensor for this model: {', '.join(map(str, valid))})"
        raise ConfigError(f"parallel.tensor: {tensor}: {'; '.join(problems)}{valid_text}")


def apply_tensor_parallel(
    model: nn.Module, tp_mesh: DeviceMesh, plan: Mapping[str, ParallelStyle] | None = None
) -> nn.Module:
    """Shard ``model`` in place by ``plan`` (default :func:`tensor_plan`) over the 1-D mesh ``tp_mesh``.

    After torch's ``parallelize_module``, a parameter the plan left alone is made a ``Replicate()`` DTensor by
    :class:`Replicated` on the module that owns it, so every parameter lives on ``tp_mesh``; weights tied before
    (a tied head) are tied again, one parameter under every name. A gradient the plan leaves ``Partial`` is
    reduced once, as it is accumulated (:func:`_reduce_partial_grad`). The weights are the mesh's first rank's:
    torch's ``distribute_tensor`` scatters its shards and broadcasts its replicas (collectives at set-up only).
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tensor_parallel: tp_mesh must be 1-D (the tensor dimension), got {tp_mesh}")
    _track_rng_without_a_broadcast(tp_mesh)
    tied = tied_names(model)
    # a LoRA model's adapted layers split with their adapters (ddpkit.models.lora_tensor)
    parallelize_module(model, tp_mesh, lora_plan(model, tensor_plan(model) if plan is None else plan))
    # a tied head still holds the plain tensor here, so it too gets Replicated's hooks before it is tied again
    for module in list(model.modules()):
        if any(not isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            parallelize_module(module, tp_mesh, Replicated())
    _retie(model, tied)
    hook_gradients(model)
    return model


def hook_gradients(model: nn.Module) -> None:
    """Give each trainable DTensor parameter of ``model`` its gradient hooks (:func:`_sliced_as_placed`,
    :func:`_reduce_partial_grad`), once; a parameter still on the meta device is skipped.

    The hooks belong to the parameter object, and ``to_empty`` makes new ones: a model built on the meta device
    (ddpkit.parallel.meta_build) gets them here once placed (ddpkit.parallel.parallelize), not from
    :func:`apply_tensor_parallel`, whose hooks went with the meta parameters. A frozen parameter (a LoRA base's)
    gets no gradient to slice or reduce."""
    for param in model.parameters():
        if isinstance(param, DTensor) and param.requires_grad and not param.is_meta:
            if not getattr(param, "_ddpkit_gradient_hooks", False):
                param.register_hook(functools.partial(_sliced_as_placed, placements=param.placements))
                param.register_post_accumulate_grad_hook(_reduce_partial_grad)
                param._ddpkit_gradient_hooks = True


def _sliced_as_placed(grad: torch.Tensor, *, placements: tuple) -> torch.Tensor:
    """A replicated gradient DTensor cut to its parameter's placements before it is accumulated (a slice, no
    collective).

    For a user's plan: torch's ``RowwiseParallel`` on an ``nn.Embedding`` (the vocabulary sharded by rows, the ids
    replicated) makes the weight's gradient ``Replicate()``, since DTensor has no sharding rule for that backward:
    the whole vocabulary matrix on every tensor rank, kept until the optimizer step and cut to the shard again
    inside each of AdamW's ops. This keeps the shard from the backward on; the whole matrix is still made first.
    ddpkit's own plans use :class:`~ddpkit.models.vocab_embedding.VocabParallelEmbedding`, whose backward makes only
    the shard. A ``Partial`` gradient is left to :func:`_reduce_partial_grad` (one all-reduce after accumulation,
    not one a micro-batch)."""
    if isinstance(grad, DTensor) and grad.placements != placements and all(p.is_replicate() for p in grad.placements):
        return grad.redistribute(placements=placements)
    return grad


def _track_rng_without_a_broadcast(tp_mesh: DeviceMesh) -> None:
    """On CUDA, DTensor's RNG tracker made now, from the ranks' own generators, not at its first dropout.

    Made lazily, the tracker broadcasts global rank 0's generator to every rank at the first random DTensor op:
    a collective inside some rank's forward (under a pipeline, at other times on other stages) that would also give
    every data-parallel replica one stream. ddpkit seeds a replica's tensor ranks alike instead
    (:func:`ddpkit.training.rng.rank_seed`), torch's own advice, so the tracker needs no broadcast. Nothing on the CPU,
    where DTensor has no random ops (dropout is refused there)."""
    from torch.distributed.tensor import _random

    if tp_mesh.device_type == "cpu" or _random._rng_tracker is not None:
        return
    _random._rng_tracker = _random.OffsetBasedRNGTracker(tp_mesh, run_state_sync=False)


def _reduce_partial_grad(param: nn.Parameter) -> None:
    """Make a gradient DTensor left ``Partial`` (a per-head norm's: each rank summed its own heads) whole, once.

    DTensor would otherwise reduce it lazily inside every op that needs it whole: the clipping norm and each of
    AdamW's foreach ops, 3 all-reduces a parameter in the optimizer step alone where this costs 1 in the backward.
    """
    grad = param.grad
    if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
        param.grad = grad.redistribute(placements=param.placements)


def _retie(model: nn.Module, tied: list[list[str]]) -> None:
    """Point every name of a tied group at the group's first DTensor (the plan made one per module)."""
    for names in tied:
        params = [model.get_parameter(name) for name in names]
        shared = next((p for p in params if isinstance(p, DTensor)), None)
        if shared is None:
            continue
        for name, param in zip(names, params):
            if isinstance(param, DTensor) and param.placements != shared.placements:
                raise ValueError(
                    f"apply_tensor_parallel: the tied parameters {names[0]} and {name} got different placements "
                    f"({shared.placements} and {param.placements}); give their modules matching styles"
                )
            owner, _, key = name.rpartition(".")
            setattr(model.get_submodule(owner), key, shared)
