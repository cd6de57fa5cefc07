"""The Llama family in ddpkit's own model: Llama 3, SmolLM2, Qwen2.5, Qwen3, Mistral, as one model with named options.

    model: {name: gpt, kwargs: {arch: llama}}                                # a small byte-level Llama
    model: {name: gpt, kwargs: {arch: llama, dim: 512, depth: 8, heads: 8, kv_heads: 2}}   # grouped-query attention
    model: {name: gpt, kwargs: {preset: qwen3-0.6b}}                         # a named shape, randomly initialised
    model: {name: gpt, kwargs: {init_from: models/Qwen2.5-0.5B}}            # a local Hugging Face directory

``forward(x[B, T] int64) -> logits[B, T, vocab_size]``. The model is ``embed -> blocks -> norm ->
head``: a token embedding (no position table), ``depth`` :class:`LlamaBlock` in ``blocks`` (an
``nn.ModuleList``), a final RMSNorm and the output layer ``head`` (tied to ``embed`` or its own).
Each block is pre-norm::

    h = x + attn(attn_norm(x))          # q_proj, k_proj, v_proj -> RoPE -> causal attention -> o_proj
    out = h + mlp(mlp_norm(h))          # down_proj(silu(gate_proj(h)) * up_proj(h)): SwiGLU

The options (:class:`LlamaShape`, every one a ``model.kwargs`` key) cover the family:

======================  ===========================================================================
``kv_heads``            key/value heads (grouped-query attention); ``heads`` by default
``head_dim``            per-head width; ``dim / heads`` by default (Qwen3 sets 128 at any ``dim``)
``mlp_dim``             the SwiGLU's inner width (``intermediate_size``)
``rope_theta``          RoPE's base; ``rope_scaling``: ``{rope_type: llama3 | linear, ...}`` (ddpkit.models.rope)
``qkv_bias``            biases on q/k/v (Qwen2.5); ``out_bias``: on o_proj; ``mlp_bias``: on the MLP
``qk_norm``             an RMSNorm over each head's queries and keys before RoPE (Qwen3)
``tied``                the output layer is the token embedding (SmolLM2, Llama 3.2, Qwen 0.5-4B)
``norm_eps``            RMSNorm's epsilon (``rms_norm_eps``)
``family``              the Hugging Face ``model_type`` it exports as: llama, qwen2, qwen3, mistral
======================  ===========================================================================

Module names follow Hugging Face's inside the blocks (``attn.q_proj`` ... ``mlp.down_proj``, separate
``nn.Linear`` each: peft's LoRA targets and a tensor plan's names), so ``init_from`` is a renaming
(ddpkit.models.hf_llama). RMSNorm computes in fp32 and casts back, as transformers' does; KV cache
(grouped: ``kv_heads`` heads are cached), document masking, activation checkpointing (``LlamaBlock``),
FSDP2's per-block units and ``torch.compile`` work as for GPT-2's ``gpt``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ddpkit.errors import ConfigError
from ddpkit.models import hf_llama
from ddpkit.models.attention import KVCache, LayerCache, causal_attention
from ddpkit.models.document_mask import Documents, documents_of
from ddpkit.models.hf_files import check_against
from ddpkit.models.hf_slices import HFWeights
from ddpkit.models.init_by_name import draw_init_seed, initialize_or_read, is_on_meta
from ddpkit.models.rope import Rotary, apply_rotary, check_scaling

__all__ = [
    "Llama",
    "LlamaBlock",
    "LlamaAttention",
    "LlamaMLP",
    "RMSNorm",
    "LlamaShape",
    "LLAMA_PRESETS",
    "FAMILIES",
    "llama_kwargs",
    "mask_padded_ids",
]

#: Hugging Face ``model_type`` values the family exports as (and ``init_from`` reads).
FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_SMOLLM2 = dict(vocab_size=49152, max_len=8192, norm_eps=1e-5, tied=True)
_LLAMA32 = dict(vocab_size=128256, max_len=131072, norm_eps=1e-5, rope_theta=5e5, rope_scaling=_LLAMA3_ROPE, tied=True)
_QWEN25 = dict(
    vocab_size=151936, max_len=32768, norm_eps=1e-6, rope_theta=1e6, tied=True, qkv_bias=True, family="qwen2"
)
_QWEN3 = dict(vocab_size=151936, max_len=40960, norm_eps=1e-6, rope_theta=1e6, tied=True, qk_norm=True, family="qwen3")
#: Named shapes of the published small models (their config.json); explicit kwargs override them.
LLAMA_PRESETS: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(**_SMOLLM2, dim=576, depth=30, heads=9, kv_heads=3, mlp_dim=1536, rope_theta=1e5),
    "smollm2-360m": dict(**_SMOLLM2, dim=960, depth=32, heads=15, kv_heads=5, mlp_dim=2560, rope_theta=1e5),
    "smollm2-1.7b": dict(**_SMOLLM2, dim=2048, depth=24, heads=32, kv_heads=32, mlp_dim=8192, rope_theta=1.3e5),
    "llama3.2-1b": dict(**_LLAMA32, dim=2048, depth=16, heads=32, kv_heads=8, head_dim=64, mlp_dim=8192),
    "llama3.2-3b": dict(**_LLAMA32, dim=3072, depth=28, heads=24, kv_heads=8, head_dim=128, mlp_dim=8192),
    "qwen2.5-0.5b": dict(**_QWEN25, dim=896, depth=24, heads=14, kv_heads=2, mlp_dim=4864),
    "qwen2.5-1.5b": dict(**_QWEN25, dim=1536, depth=28, heads=12, kv_heads=2, mlp_dim=8960),
    "qwen3-0.6b": dict(**_QWEN3, dim=1024, depth=28, heads=16, kv_heads=8, head_dim=128, mlp_dim=3072),
    "qwen3-1.7b": dict(**_QWEN3, dim=2048, depth=28, heads=16, kv_heads=8, head_dim=128, mlp_dim=6144),
}


@dataclass(frozen=True)
class LlamaShape:
    """The Llama family's options (the module docstring's table); unset widths follow the family's rules."""

    vocab_size: int = 257
    dim: int = 256
    depth: int = 4
    heads: int = 4
    kv_heads: int | None = None
    head_dim: int | None = None
    mlp_dim: int | None = None
    max_len: int = 256
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tied: bool = True
    dropout: float = 0.0
    valid_vocab: int | None = None
    family: str = "llama"

    def __post_init__(self) -> None:
        _check_integers(self)
        heads = self.heads
        kv_heads = heads if self.kv_heads is None else self.kv_heads
        if heads % kv_heads:
            raise ConfigError(
                f"model.kwargs.kv_heads: {kv_heads} does not divide heads {heads}; each key/value head serves "
                f"a whole group of query heads (choose one of {', '.join(str(d) for d in _divisors(heads))})"
            )
        if self.head_dim is None and self.dim % heads:
            raise ConfigError(
                f"model.kwargs.heads: dim {self.dim} is not divisible by heads {heads}; choose heads that divide "
                "dim, or set model.kwargs.head_dim"
            )
        head_dim = self.head_dim or self.dim // heads
        if head_dim % 2:
            raise ConfigError(f"model.kwargs.head_dim: {head_dim} is odd; RoPE rotates pairs of dimensions")
        if self.family not in FAMILIES:
            raise ConfigError(f"model.kwargs.family: {self.family!r} is not one of {', '.join(FAMILIES)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.kwargs.dropout: expected a probability in [0, 1), got {self.dropout!r}")
        if self.valid_vocab is not None and not 1 <= self.valid_vocab <= self.vocab_size:
            raise ConfigError(f"model.kwargs.valid_vocab: expected an integer in [1, vocab_size={self.vocab_size}]")
        object.__setattr__(self, "kv_heads", kv_heads)
        object.__setattr__(self, "head_dim", head_dim)
        object.__setattr__(self, "mlp_dim", self.mlp_dim or _swiglu_width(self.dim))
        object.__setattr__(self, "rope_scaling", check_scaling(self.rope_scaling, where="model.kwargs.rope_scaling"))

    def to_kwargs(self) -> dict[str, Any]:
        """The options as ``model.kwargs`` (every width resolved)."""
        return dataclasses.asdict(self)


def _check_integers(shape: LlamaShape) -> None:
    for key in ("vocab_size", "dim", "depth", "heads", "max_len", "kv_heads", "head_dim", "mlp_dim"):
        value = getattr(shape, key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigError(f"model.kwargs.{key}: expected a positive integer, got {value!r}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _swiglu_width(dim: int) -> int:
    """Llama's default inner width: 2/3 of 4 x dim (the same parameters as a 4x GELU MLP), up to a multiple of 64."""
    return 64 * math.ceil(int(8 * dim / 3) / 64)


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, computed in fp32 and cast back (transformers' ``LlamaRMSNorm``)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class LlamaAttention(nn.Module):
    """Grouped-query causal attention with RoPE: q/k/v/o as separate ``nn.Linear``, optional q/k RMSNorms."""

    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.head_dim = shape.head_dim
        self.dropout = shape.dropout
        inner = shape.heads * shape.head_dim
        kv_inner = shape.kv_heads * shape.head_dim
        self.q_proj = nn.Linear(shape.dim, inner, bias=shape.qkv_bias)
        self.k_proj = nn.Linear(shape.dim, kv_inner, bias=shape.qkv_bias)
        self.v_proj = nn.Linear(shape.dim, kv_inner, bias=shape.qkv_bias)
        self.o_proj = nn.Linear(inner, shape.dim, bias=shape.out_bias)
        self.q_norm = RMSNorm(shape.head_dim, shape.norm_eps) if shape.qk_norm else None
        self.k_norm = RMSNorm(shape.head_dim, shape.norm_eps) if shape.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: LayerCache | None = None,
        documents: Documents | None = None,
    ) -> torch.Tensor:
        batch, length, _ = x.shape
        # -1 heads: under a tensor plan each rank holds a slice of the heads
        q = self.q_proj(x).view(batch, length, -1, self.head_dim)
        k = self.k_proj(x).view(batch, length, -1, self.head_dim)
        v = self.v_proj(x).view(batch, length, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        cos, sin = rope
        q = apply_rotary(q.transpose(1, 2), cos, sin)
        k = apply_rotary(k.transpose(1, 2), cos, sin)
        dropout = self.dropout if self.training else 0.0
        y = causal_attention(q, k, v, cache=cache, documents=documents, dropout=dropout)
        return self.o_proj(y.transpose(1, 2).reshape(batch, length, -1))


class LlamaMLP(nn.Module):
    """SwiGLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.gate_proj = nn.Linear(shape.dim, shape.mlp_dim, bias=shape.mlp_bias)
        self.up_proj = nn.Linear(shape.dim, shape.mlp_dim, bias=shape.mlp_bias)
        self.down_proj = nn.Linear(shape.mlp_dim, shape.dim, bias=shape.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    """Pre-RMSNorm block: ``x + attn(attn_norm(x))``, then ``x + mlp(mlp_norm(x))``."""

    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.attn_norm = RMSNorm(shape.dim, shape.norm_eps)
        self.attn = LlamaAttention(shape)
        self.mlp_norm = RMSNorm(shape.dim, shape.norm_eps)
        self.mlp = LlamaMLP(shape)
        self.drop = nn.Dropout(shape.dropout)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: LayerCache | None = None,
        documents: Documents | None = None,
    ) -> torch.Tensor:
        x = x + self.drop(self.attn(self.attn_norm(x), rope, cache, documents))
        return x + self.drop(self.mlp(self.mlp_norm(x)))


class Llama(nn.Module):
    """The Llama family: ``embed -> blocks -> norm -> head`` (see the module docstring).

    model = Llama(LlamaShape(vocab_size=257, dim=256, depth=4, heads=4, kv_heads=2))
    logits = model(x)                                  # x: [B, T] int64, T <= max_len -> [B, T, 257]
    h = model.embed(x); rope = model.rotation(x)       # the parts one at a time, as a pipeline stage runs them
    h = model.blocks[0](h, rope); logits = model.logits(h)
    """

    def __init__(self, shape: LlamaShape):
        super().__init__()
        # First, before any submodule draws: the same seed whether built on the CPU or on the meta device.
        self.init_seed = draw_init_seed()
        #: The Hugging Face directory ``init_weights`` reads (``init_from``: ddpkit.models.hf_slices.HFWeights);
        #: None: drawn by name from the seed.
        self.weights_from: HFWeights | None = None
        self.shape = shape
        self.vocab_size = shape.vocab_size
        self.dim = shape.dim
        self.depth = shape.depth
        self.max_len = shape.max_len
        self.heads = shape.heads
        self.kv_heads = shape.kv_heads
        self.head_dim = shape.head_dim
        #: Ids from here up are padding: their logits are -inf (None: every id is real).
        self.valid_vocab = shape.valid_vocab if shape.valid_vocab and shape.valid_vocab < shape.vocab_size else None
        self.embed = nn.Embedding(shape.vocab_size, shape.dim)
        self.rope = Rotary(shape.head_dim, shape.rope_theta, shape.rope_scaling)
        self.drop = nn.Dropout(shape.dropout)
        self.blocks = nn.ModuleList(LlamaBlock(shape) for _ in range(shape.depth))
        self.norm = RMSNorm(shape.dim, shape.norm_eps)
        self.head = nn.Linear(shape.dim, shape.vocab_size, bias=False)
        if shape.tied:
            # one [vocab, dim] matrix reads tokens in and scores them out
            self.head.weight = self.embed.weight
        if not is_on_meta(self):
            self.init_weights()
        self.documents: dict[str, Any] | None = None

    #: How a pipeline cuts this family (ddpkit.parallel.pipeline_split): the parts read before the blocks on the
    #: first stage, on every stage (RoPE's tables), and after the blocks on the last.
    stage_parts = {"first": ("embed", "drop"), "every": ("rope",), "last": ("norm", "head")}

    @staticmethod
    def stage_input(parts: nn.Module, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        """The first stage's input to the blocks: the token embeddings of ``x`` (``parts`` holds them)."""
        return parts.drop(parts.embed(x))

    @staticmethod
    def stage_rotation(
        parts: nn.Module, h: torch.Tensor, documents: Documents | None = None, length: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's ``(cos, sin)`` for a stage's input ``h``, each block's second argument; restarted in each of
        ``documents`` when the model restarts positions (``parts.documents``), as :meth:`rotation` does.
        ``length``: the whole sequence's, where ``h`` holds a rank's slice of it (sequence parallelism)."""
        restart = documents is not None and (getattr(parts, "documents", None) or {}).get("restart_positions")
        whole = h.shape[1] if length is None else length
        positions = documents.positions if restart else torch.arange(whole, device=h.device)
        return parts.rope(positions, dtype=h.dtype)

    @staticmethod
    def stage_output(parts: nn.Module, h: torch.Tensor) -> torch.Tensor:
        """The last stage's logits of the blocks' output ``h`` (before the padded ids are masked)."""
        return parts.head(parts.norm(h))

    def init_weights(self, parts: nn.Module | None = None) -> None:
        """GPT-2's initialisation, each parameter drawn by its name (ddpkit.models.init_by_name), of ``parts`` (any
        part of this model under its names) or of the whole model; RoPE's frequencies recomputed. With ``init_from``,
        the directory's weights instead, only the slices ``parts`` holds read (ddpkit.models.hf_slices)."""
        residuals = [f"blocks.{i}.{name}" for i in range(self.depth) for name in ("attn.o_proj", "mlp.down_proj")]
        initialize_or_read(self, parts, residuals=residuals)

    def tensor_plan(self, *, vocab_parallel: bool = False, sequence_parallel: bool = False) -> dict[str, Any]:
        """This model's tensor plan: q/k/v and gate/up colwise, o/down rowwise (ddpkit.models.tensor_plans)."""
        from ddpkit.models.tensor_plans import llama_plan

        return llama_plan(self, vocab_parallel=vocab_parallel, sequence_parallel=sequence_parallel)

    def use_documents(self, *, eot: int, restart_positions: bool = False) -> None:
        """Attend within the documents ``eot`` separates (``data.kwargs.document_mask``; training.document_mask)."""
        self.documents = {"eot": eot, "restart_positions": restart_positions}

    def forward(self, x: torch.Tensor, *, cache: KVCache | None = None) -> torch.Tensor:
        """Next-token logits ``[B, T, vocab_size]``; with ``cache``, ``x`` continues the cached tokens."""
        start = cache.length if cache is not None else 0
        _check_length(start + x.shape[1], self.max_len)
        documents = None if cache is not None or self.documents is None else documents_of(x, **self.documents)
        h = self.drop(self.embed(x))
        rope = self.rotation(x, start=start, documents=documents, dtype=h.dtype)
        for i, block in enumerate(self.blocks):
            h = block(h, rope, cache.layers[i] if cache is not None else None, documents)
        return self.logits(h)

    def rotation(
        self, x: torch.Tensor, *, start: int = 0, documents: Documents | None = None, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's ``(cos, sin)`` for the tokens ``x`` (from position ``start``, or restarting in each document)."""
        if documents is not None and self.documents and self.documents["restart_positions"]:
            positions = documents.positions
        else:
            positions = torch.arange(start, start + x.shape[1], device=x.device)
        return self.rope(positions, dtype=dtype or self.embed.weight.dtype)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The final norm and the output layer; padded ids (``valid_vocab``) get -inf."""
        return mask_padded_ids(self.head(self.norm(h)), self.valid_vocab)

    def make_cache(self, batch: int) -> KVCache:
        """An empty :class:`KVCache` (``kv_heads`` heads) for ``batch`` sequences (ddpkit.models.generation)."""
        return KVCache(self, batch=batch)

    def num_params(self, *, non_embedding: bool = True) -> int:
        """Parameters (a tied output layer counted once); ``non_embedding`` leaves out an untied input embedding
        (a lookup, no matrix multiply; tied, it is the output layer's matrix)."""
        total = sum(p.numel() for p in self.parameters())
        untied = self.head.weight is not self.embed.weight
        return total - self.embed.weight.numel() if non_embedding and untied else total

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token: ``6 * N + 12 * depth * heads * head_dim * seq_len`` (PaLM's appendix B;
        ``N = num_params(non_embedding=True)``; the attention term counts the query heads' scores and sums)."""
        length = self.max_len if seq_len is None else seq_len
        return 6 * self.num_params(non_embedding=True) + 12 * self.depth * self.heads * self.head_dim * length


def _check_length(length: int, max_len: int) -> None:
    if length > max_len:
        raise ConfigError(
            f"model.kwargs.max_len: the input has {length} tokens per sequence but the model's max_len is {max_len}; "
            f"lower data.kwargs.seq_len to {max_len} or raise model.kwargs.max_len to {length}"
        )


def llama_kwargs(preset: str | None = None, init_from: str | None = None, **given: Any) -> dict[str, Any]:
    """:class:`LlamaShape`'s kwargs resolved: a preset's (or the defaults), or those of the Hugging Face directory
    ``init_from``, with the explicit kwargs on top (a contradiction of the directory's is refused by name)."""
    # None is "not given", as for GPT-2's kwargs: the preset's, the directory's or the family's rule applies
    given = {key: value for key, value in given.items() if value is not None}
    unknown = sorted(set(given) - set(LlamaShape.__dataclass_fields__))
    if unknown:
        raise ConfigError(
            f"model.kwargs: unexpected keyword argument {unknown[0]!r} for model 'gpt'; it accepts: "
            f"preset, init_from, arch, {', '.join(LlamaShape.__dataclass_fields__)}"
        )
    if init_from is None:
        return LlamaShape(**{**LLAMA_PRESETS.get(preset, {}), **given}).to_kwargs()
    base, window = hf_llama.read_config(init_from)
    source = f"{init_from}/config.json"
    check_against(base, {k: v for k, v in given.items() if k != "valid_vocab"}, source=source)
    kwargs = {**base, **given, "valid_vocab": base["vocab_size"]}
    hf_llama.check_window(window, max_len=kwargs["max_len"], source=source)
    return LlamaShape(**kwargs).to_kwargs()


def mask_padded_ids(logits: torch.Tensor, valid_vocab: int | None) -> torch.Tensor:
    """``logits`` with the padded ids past ``valid_vocab`` at -inf: probability 0, no gradient, the loss unchanged.

    Out of place: under a tensor plan or a vocabulary split the head's output is a view made by a custom autograd
    Function (DTensor's ``to_local``), which autograd forbids modifying in place. The same bits as an in-place fill.
    """
    if valid_vocab is None:
        return logits
    padded = torch.arange(logits.shape[-1], device=logits.device) >= valid_vocab
    return logits.masked_fill(padded, float("-inf"))
