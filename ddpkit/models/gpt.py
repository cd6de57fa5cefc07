"""A GPT-2 style language model, registered as ``gpt``.

    model: {name: gpt, kwargs: {vocab_size: 257, dim: 256, depth: 4, heads: 4, max_len: 256}}   # small, byte-level
    model: {name: gpt, kwargs: {preset: gpt2}}                     # the 124M shape (vocab 50304, 768 x 12, 12 heads)
    model: {name: gpt, kwargs: {preset: gpt2, max_len: 512}}       # explicit kwargs override the preset
    model: {name: gpt, kwargs: {init_from: models/gpt2}}           # a local Hugging Face GPT-2 directory (hf_gpt2.py)

``forward(x[B, T] int64) -> logits[B, T, vocab_size]``, the next token's logits at every position.
The shape is nanoGPT's: learned position embeddings, pre-LayerNorm blocks of causal attention
(``scaled_dot_product_attention(..., is_causal=True)``, flash attention on GPUs) and a 4x GELU
MLP, a final LayerNorm, and an output layer tied to the token embedding. Initialisation is
GPT-2's: normal(0, 0.02) weights, the residual projections scaled by 1/sqrt(2 * depth), zero biases.
``activation: gelu_tanh`` is GPT-2's own tanh approximation (what its pretrained weights expect);
``valid_vocab`` (< ``vocab_size``) gives the padded ids a logit of -inf, so they are never predicted
and the loss is the unpadded vocabulary's. ``forward(x, cache=KVCache(...))`` appends the new tokens'
keys and values to a cache and attends over all of them: generation feeds one token a step.

The blocks are ``GPT.blocks``, an ``nn.ModuleList`` of :class:`GPTBlock`: FSDP2's default rule
(:func:`ddpkit.parallel.fsdp.fsdp_blocks`) shards each block as one unit, then the position embedding and the final
LayerNorm as units of their own (:func:`ddpkit.parallel.fsdp.fsdp_ends`); the root keeps the tied token embedding.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ddpkit.errors import ConfigError
from ddpkit.models import hf_llama
from ddpkit.models.attention import KVCache, LayerCache, causal_attention
from ddpkit.models.document_mask import Documents, documents_of
from ddpkit.models.hf_files import check_against, family_of
from ddpkit.models.hf_gpt2 import read_config, wanted
from ddpkit.models.hf_slices import HFWeights
from ddpkit.models.init_by_name import draw_init_seed, initialize_or_read, is_on_meta
from ddpkit.models.llama import FAMILIES, LLAMA_PRESETS, Llama, LlamaShape, llama_kwargs, mask_padded_ids
from ddpkit.registry import register_model

__all__ = ["GPT", "GPTBlock", "CausalSelfAttention", "KVCache", "PRESETS", "ACTIVATIONS", "gpt", "gpt_kwargs"]

#: Named shapes; explicit kwargs override them. gpt2's vocabulary is 50257 padded to a multiple of 64.
PRESETS = {
    "gpt2": {"vocab_size": 50304, "dim": 768, "depth": 12, "heads": 12, "max_len": 1024},
}
#: The two families of the ``gpt`` builder (``model.kwargs.arch``).
ARCHS = ("gpt2", "llama")
#: The shape without a preset: a small byte-level model (ddpkit's byte tokens and stdlib corpus have 257 ids).
DEFAULTS = {"vocab_size": 257, "dim": 256, "depth": 4, "heads": 4, "max_len": 256}
#: ``activation`` names -> ``F.gelu``'s ``approximate``: exact GELU, or the tanh approximation GPT-2 was trained with.
ACTIVATIONS = {"gelu": "none", "gelu_tanh": "tanh"}


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: one fused q/k/v projection, torch's SDPA kernel, an output projection."""

    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)  # a residual projection: GPT-2 scales its initial weights

    def forward(
        self, x: torch.Tensor, cache: LayerCache | None = None, documents: Documents | None = None
    ) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        dropout = self.dropout if self.training else 0.0
        y = causal_attention(q, k, v, cache=cache, documents=documents, dropout=dropout)
        return self.proj(y.transpose(1, 2).reshape(batch, length, dim))


class GPTBlock(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))`` (a 4x GELU MLP)."""

    def __init__(self, dim: int, heads: int, dropout: float = 0.0, activation: str = "gelu"):
        super().__init__()
        self.approximate = ACTIVATIONS[activation]
        self.ln1 = nn.LayerNorm(dim)
        self.ln2 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, dropout)
        self.fc = nn.Linear(dim, 4 * dim)
        self.proj = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(
        self, x: torch.Tensor, cache: LayerCache | None = None, documents: Documents | None = None
    ) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x), cache, documents))
        return x + self.drop(self.proj(F.gelu(self.fc(self.ln2(x)), approximate=self.approximate)))


class GPT(nn.Module):
    """GPT-2: token + position embeddings, ``depth`` :class:`GPTBlock`, a final LayerNorm, a tied output layer.

    model = GPT(vocab_size=257, dim=256, depth=4, heads=4, max_len=256)
    logits = model(x)                                        # x: [B, T] int64, T <= max_len -> [B, T, 257]
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    model.flops_per_token(seq_len=256)                       # training FLOPs per token, for MFU
    """

    def __init__(
        self,
        vocab_size: int = 257,
        dim: int = 256,
        depth: int = 4,
        heads: int = 4,
        max_len: int = 256,
        dropout: float = 0.0,
        activation: str = "gelu",
        valid_vocab: int | None = None,
    ):
        super().__init__()
        # First, before any submodule draws: the same seed whether built on the CPU or on the meta device.
        self.init_seed = draw_init_seed()
        #: The Hugging Face directory ``init_weights`` reads (``init_from``); None: drawn by name from the seed.
        self.weights_from: HFWeights | None = None
        _check_shape(vocab_size=vocab_size, dim=dim, depth=depth, heads=heads, max_len=max_len, dropout=dropout)
        _check_options(activation, valid_vocab, vocab_size)
        self.vocab_size = vocab_size
        self.dim = dim
        self.depth = depth
        self.heads = heads
        self.max_len = max_len
        # what the KV cache reads: every head has its own keys and values
        self.kv_heads = heads
        self.head_dim = dim // heads
        self.activation = activation
        #: Ids from here up are padding: their logits are -inf (None: every id is real).
        self.valid_vocab = valid_vocab if valid_vocab is not None and valid_vocab < vocab_size else None
        self.embed = nn.Embedding(vocab_size, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(GPTBlock(dim, heads, dropout, activation) for _ in range(depth))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        self.head.weight = self.embed.weight  # tied: one [vocab, dim] matrix reads tokens in and scores them out
        if not is_on_meta(self):
            self.init_weights()
        self.documents: dict[str, Any] | None = None  # use_documents: per-document attention and positions

    #: How a pipeline cuts this family (ddpkit.parallel.pipeline_split): the parts read before the blocks on the
    #: first stage, on every stage, and after the blocks on the last.
    stage_parts = {"first": ("embed", "pos", "drop"), "every": (), "last": ("ln_f", "head")}

    @staticmethod
    def stage_input(parts: nn.Module, x: torch.Tensor, documents: Documents | None = None) -> torch.Tensor:
        """The first stage's input to the blocks: token and position embeddings of ``x`` (``parts`` holds them); with
        ``documents``, their positions (restarted in each document where asked), as :meth:`forward` takes them."""
        positions = torch.arange(x.shape[1], device=x.device) if documents is None else documents.positions
        return parts.drop(parts.embed(x) + parts.pos(positions))

    @staticmethod
    def stage_rotation(
        parts: nn.Module, h: torch.Tensor, documents: Documents | None = None, length: int | None = None
    ) -> None:
        """What each block takes besides its input on a stage: nothing (learned positions)."""
        return None

    @staticmethod
    def stage_output(parts: nn.Module, h: torch.Tensor) -> torch.Tensor:
        """The last stage's logits of the blocks' output ``h`` (before the padded ids are masked)."""
        return parts.head(parts.ln_f(h))

    def init_weights(self, parts: nn.Module | None = None) -> None:
        """GPT-2's initialisation, each parameter drawn by its name (ddpkit.models.init_by_name): of ``parts`` (any
        part of this model under its names, materialised with ``to_empty``), or of the whole model. Residual
        projections (two per block add to the stream) get std 0.02 / sqrt(2 * depth). With ``init_from``, the
        directory's weights instead, only the slices ``parts`` holds read (ddpkit.models.hf_slices)."""
        residuals = [f"blocks.{i}.{name}" for i in range(self.depth) for name in ("attn.proj", "proj")]
        initialize_or_read(self, parts, residuals=residuals)

    def tensor_plan(self, *, vocab_parallel: bool = False, sequence_parallel: bool = False) -> dict[str, Any]:
        """This model's tensor plan: each block's MLP split, its fused attention whole (ddpkit.models.tensor_plans)."""
        from ddpkit.models.tensor_plans import gpt2_plan

        return gpt2_plan(self, vocab_parallel=vocab_parallel, sequence_parallel=sequence_parallel)

    def use_documents(self, *, eot: int, restart_positions: bool = False) -> None:
        """Attend within the documents ``eot`` separates (``data.kwargs.document_mask``; training.document_mask)."""
        self.documents = {"eot": eot, "restart_positions": restart_positions}

    def forward(self, x: torch.Tensor, *, cache: KVCache | None = None) -> torch.Tensor:
        """Next-token logits ``[B, T, vocab_size]``; with ``cache``, ``x`` continues the cached tokens."""
        start = cache.length if cache is not None else 0
        length = start + x.shape[1]
        if length > self.max_len:
            raise ConfigError(
                f"model.kwargs.max_len: the input has {length} tokens per sequence but the model's max_len is "
                f"{self.max_len}; "
                f"lower data.kwargs.seq_len to {self.max_len} or raise model.kwargs.max_len to {length}"
            )
        documents = None if cache is not None or self.documents is None else documents_of(x, **self.documents)
        positions = torch.arange(start, length, device=x.device) if documents is None else documents.positions
        h = self.drop(self.embed(x) + self.pos(positions))
        for i, block in enumerate(self.blocks):
            h = block(h, cache.layers[i] if cache is not None else None, documents)
        return mask_padded_ids(self.head(self.ln_f(h)), self.valid_vocab)

    def make_cache(self, batch: int) -> KVCache:
        """An empty :class:`KVCache` for ``batch`` sequences (the sampling protocol of ddpkit.models.generation)."""
        return KVCache(self, batch=batch)

    def num_params(self, *, non_embedding: bool = True) -> int:
        """Parameters (the tied output layer counted once); ``non_embedding`` leaves out the position embeddings
        (nanoGPT's count)."""
        total = sum(p.numel() for p in self.parameters())
        return total - self.pos.weight.numel() if non_embedding else total

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs (forward + backward) per token: ``6 * N + 12 * depth * dim * seq_len``.

        The PaLM paper's formula (appendix B), as nanoGPT's ``estimate_mfu`` uses it: ``6 * N`` for the
        matrix multiplies, with ``N = num_params(non_embedding=True)`` (the token embedding stays in:
        tied, it is the output layer's matrix), plus ``12 * depth * heads * head_dim * T`` for the
        attention scores and their weighted sum (``heads * head_dim = dim``). ``seq_len`` is the
        training context ``T`` (default ``max_len``). MFU = tokens/s * this / the device's peak FLOP/s.
        """
        length = self.max_len if seq_len is None else seq_len
        return 6 * self.num_params(non_embedding=True) + 12 * self.depth * self.dim * length


def _check_shape(**shape: float) -> None:
    for key in ("vocab_size", "dim", "depth", "heads", "max_len"):
        if not isinstance(shape[key], int) or shape[key] < 1:
            raise ConfigError(f"model.kwargs.{key}: expected a positive integer, got {shape[key]!r}")
    if shape["dim"] % shape["heads"]:
        divisors = [h for h in range(1, min(shape["dim"], 64) + 1) if shape["dim"] % h == 0]
        raise ConfigError(
            f"model.kwargs.heads: dim {shape['dim']} is not divisible by heads {shape['heads']}; "
            f"choose heads that divide dim (e.g. {', '.join(map(str, divisors[-4:]))}) or change model.kwargs.dim"
        )
    if not 0.0 <= shape["dropout"] < 1.0:
        raise ConfigError(f"model.kwargs.dropout: expected a probability in [0, 1), got {shape['dropout']!r}")


def _check_options(activation: str, valid_vocab: int | None, vocab_size: int) -> None:
    if activation not in ACTIVATIONS:
        raise ConfigError(
            f"model.kwargs.activation: unknown activation {activation!r}; choose one of {', '.join(ACTIVATIONS)} "
            "(gelu_tanh is GPT-2's own)"
        )
    if valid_vocab is not None and not (isinstance(valid_vocab, int) and 1 <= valid_vocab <= vocab_size):
        raise ConfigError(
            f"model.kwargs.valid_vocab: expected an integer in [1, vocab_size={vocab_size}], got {valid_vocab!r}"
        )


def gpt_kwargs(
    preset: str | None = None,
    vocab_size: int | None = None,
    dim: int | None = None,
    depth: int | None = None,
    heads: int | None = None,
    max_len: int | None = None,
    dropout: float = 0.0,
    activation: str | None = None,
    valid_vocab: int | None = None,
    init_from: str | None = None,
) -> dict[str, Any]:
    """:class:`GPT`'s keyword arguments for the ``gpt`` builder's: a preset's shape (or :data:`DEFAULTS`), or the shape
    of the GPT-2 directory ``init_from``, with the explicit kwargs on top (a contradiction is refused by name)."""
    arch_of(preset, init_from, "gpt2")
    given = dict(vocab_size=vocab_size, dim=dim, depth=depth, heads=heads, max_len=max_len, activation=activation)
    given = {k: v for k, v in given.items() if v is not None}
    if init_from is None:
        base = {**DEFAULTS, "activation": "gelu", **(PRESETS[preset] if preset else {})}
        return {**base, **given, "dropout": dropout, "valid_vocab": valid_vocab}
    shape = read_config(init_from)
    check_against(shape, given, source=f"{init_from}/config.json")
    return {**shape, **given, "dropout": dropout, "valid_vocab": shape["vocab_size"]}


def arch_of(preset: str | None = None, init_from: str | None = None, arch: str | None = None) -> str:
    """Which model the ``gpt`` kwargs describe: ``gpt2`` (GPT-2, the default) or ``llama`` (the Llama family),
    from ``arch``, else the preset's family, else the ``model_type`` of ``init_from``'s config.json."""
    if arch is not None and arch not in ARCHS:
        raise ConfigError(f"model.kwargs.arch: {arch!r} is not one of {', '.join(ARCHS)}")
    if preset is not None and init_from is not None:
        raise ConfigError(
            "model.kwargs.preset: give either preset or init_from (whose config.json is the shape), not both"
        )
    found = None
    if preset is not None:
        if preset not in PRESETS and preset not in LLAMA_PRESETS:
            raise ConfigError(
                f"model.kwargs.preset: unknown preset {preset!r}; choose one of "
                f"{', '.join([*PRESETS, *LLAMA_PRESETS])}, or give the shape's kwargs"
            )
        found = "gpt2" if preset in PRESETS else "llama"
    elif init_from is not None:
        family = family_of(init_from)
        if family != "gpt2" and family not in FAMILIES:
            raise ConfigError(
                f"model.kwargs.init_from: {init_from}/config.json is a {family!r} model; the gpt model loads "
                f"gpt2, {', '.join(FAMILIES)} (SmolLM2 is a llama); train other causal LMs with "
                "examples/hf_causal_lm.py"
            )
        found = "gpt2" if family == "gpt2" else "llama"
    if arch is not None and found is not None and arch != found:
        source = f"preset {preset}" if preset is not None else f"{init_from}/config.json"
        raise ConfigError(f"model.kwargs.arch: {arch!r} contradicts {source}, which is a {found} model; drop arch")
    return arch or found or "gpt2"


def resolve(kwargs: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``(arch, kwargs)``: the ``gpt`` kwargs of a config resolved to :class:`GPT`'s or :class:`LlamaShape`'s."""
    kwargs = dict(kwargs)
    arch = arch_of(kwargs.get("preset"), kwargs.get("init_from"), kwargs.pop("arch", None))
    if arch == "llama":
        return arch, llama_kwargs(**kwargs)
    accepted = list(inspect.signature(gpt_kwargs).parameters)
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        llama = unknown[0] in LlamaShape.__dataclass_fields__
        fix = "; it is an option of the Llama family: add model.kwargs.arch: llama" if llama else ""
        raise ConfigError(
            f"model.kwargs: unexpected keyword argument {unknown[0]!r} for model 'gpt'; it accepts: "
            f"{', '.join(accepted)}, arch (arch: gpt2){fix}"
        )
    return arch, gpt_kwargs(**kwargs)


def build_gpt(kwargs: dict[str, Any], *, weights: bool = True) -> GPT | Llama:
    """The model of the ``gpt`` kwargs; with ``weights`` and ``init_from``, the directory's weights loaded.

    Built on the meta device (ddpkit.parallel.meta_build), the directory is only checked: each rank reads the
    tensors and slices it holds when its part is made (``init_weights(parts)``). Built on the CPU, the weights are
    read now, one tensor at a time, into the parameters."""
    arch, resolved = resolve(kwargs)
    init_from = kwargs.get("init_from") if weights else None
    model = Llama(LlamaShape(**resolved)) if arch == "llama" else GPT(**resolved)
    if init_from is not None:
        shapes = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}
        if arch == "llama":
            where = hf_llama.wanted(list(shapes), tied=resolved["tied"])
        else:
            where = wanted(model.depth)
        model.weights_from = HFWeights.open(init_from, where, shapes)
        if not is_on_meta(model):
            model.init_weights()
    return model


def gpt(preset: str | None = None, **kwargs: Any) -> GPT | Llama:
    """The ``gpt`` builder: GPT-2 (:class:`GPT`) or the Llama family (:class:`Llama`: ``arch: llama``, one of
    :data:`LLAMA_PRESETS`, or an ``init_from`` directory of that family), with ``init_from``'s weights."""
    return build_gpt({"preset": preset, **kwargs})


register_model("gpt", gpt)
