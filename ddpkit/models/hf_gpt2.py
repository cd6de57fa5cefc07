"""Hugging Face GPT-2 directories in and out of ddpkit's ``gpt`` model: the names, the shapes, the files.

    model: {name: gpt, kwargs: {init_from: models/gpt2}}                     # shape and weights from the directory
    model: {name: gpt, kwargs: {init_from: models/gpt2, vocab_size: 50304}}  # padded; the pad is never predicted
    $ ddpkit export runs/ft/checkpoints out/gpt2-ft --format hf             # and back: config.json + model.safetensors

A directory is what ``GPT2LMHeadModel.save_pretrained`` writes: ``config.json`` (``model_type:
gpt2``) and ``model.safetensors`` (or ``pytorch_model.bin``, or shards named by
``model.safetensors.index.json``). Nothing is downloaded, and ``transformers`` is not needed.

The two models compute the same function once three things are taken care of: GPT-2's ``Conv1D``
layers store their weights as ``[in, out]`` (transposed here into ``nn.Linear``'s ``[out, in]``);
GPT-2 uses the tanh approximation of GELU (``activation_function: gelu_new``: ``activation:
gelu_tanh``); and its 50,257-id vocabulary is kept, or padded (``vocab_size`` larger) with rows of
zeros whose logits the model sets to -inf (``valid_vocab``), so the loss and samples are unchanged.
``max_len`` may crop the position table. Logits agree with the Hugging Face model's within 1e-4 in
fp32 (tests/test_hf_gpt2.py).

This module reads and writes plain dicts of tensors and never imports the model; the ``gpt``
builder (:mod:`ddpkit.models.gpt`) calls it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ddpkit.errors import CheckpointError, ConfigError
from ddpkit.models.hf_files import read_hf_config, safetensors_torch
from ddpkit.models.hf_slices import Wanted

__all__ = [
    "read_config",
    "wanted",
    "to_hf",
    "hf_name",
    "hf_config",
    "safetensors_torch",
    "ACTIVATION_OF_HF",
    "HF_OF_ACTIVATION",
]

#: ``activation_function`` values of a GPT-2 config.json -> the ``gpt`` model's ``activation``.
ACTIVATION_OF_HF = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
#: And back, for export.
HF_OF_ACTIVATION = {"gelu_tanh": "gelu_new", "gelu": "gelu"}
#: ddpkit name (``{i}``: a block) -> GPT-2's, and whether the weight is a transposed Conv1D.
_NAMES = {
    "embed.weight": ("wte.weight", False),
    "pos.weight": ("wpe.weight", False),
    "ln_f.weight": ("ln_f.weight", False),
    "ln_f.bias": ("ln_f.bias", False),
    "blocks.{i}.ln1.weight": ("h.{i}.ln_1.weight", False),
    "blocks.{i}.ln1.bias": ("h.{i}.ln_1.bias", False),
    "blocks.{i}.ln2.weight": ("h.{i}.ln_2.weight", False),
    "blocks.{i}.ln2.bias": ("h.{i}.ln_2.bias", False),
    "blocks.{i}.attn.qkv.weight": ("h.{i}.attn.c_attn.weight", True),
    "blocks.{i}.attn.qkv.bias": ("h.{i}.attn.c_attn.bias", False),
    "blocks.{i}.attn.proj.weight": ("h.{i}.attn.c_proj.weight", True),
    "blocks.{i}.attn.proj.bias": ("h.{i}.attn.c_proj.bias", False),
    "blocks.{i}.fc.weight": ("h.{i}.mlp.c_fc.weight", True),
    "blocks.{i}.fc.bias": ("h.{i}.mlp.c_fc.bias", False),
    "blocks.{i}.proj.weight": ("h.{i}.mlp.c_proj.weight", True),
    "blocks.{i}.proj.bias": ("h.{i}.mlp.c_proj.bias", False),
}
#: Settings of GPT-2's architecture the ``gpt`` model does not have: refused unless at these values.
_FIXED = {
    "layer_norm_epsilon": 1e-5,
    "scale_attn_by_inverse_layer_idx": False,
    "reorder_and_upcast_attn": False,
    "scale_attn_weights": True,
    "tie_word_embeddings": True,
}


def read_config(directory: str | os.PathLike) -> dict[str, Any]:
    """The ``gpt`` kwargs (vocab_size, dim, depth, heads, max_len, activation) of the GPT-2 in ``directory``."""
    path = Path(directory) / "config.json"
    config = read_hf_config(directory)
    if config.get("model_type") != "gpt2":
        raise ConfigError(f"model.kwargs.init_from: {path} is a {config.get('model_type')!r} model, not GPT-2")
    activation = ACTIVATION_OF_HF.get(config.get("activation_function", "gelu_new"))
    if activation is None:
        raise ConfigError(
            f"model.kwargs.init_from: {path}: activation_function {config['activation_function']!r} is not one the gpt "
            f"model has ({', '.join(ACTIVATION_OF_HF)})"
        )
    for key, value in _FIXED.items():
        if config.get(key, value) != value:
            raise ConfigError(
                f"model.kwargs.init_from: {path}: {key}={config[key]!r}; the gpt model supports only {value!r}"
            )
    if config.get("n_inner") not in (None, 4 * config["n_embd"]):
        raise ConfigError(
            f"model.kwargs.init_from: {path}: n_inner={config['n_inner']}; the gpt model's MLP is 4 x n_embd"
        )
    return {
        "vocab_size": config["vocab_size"],
        "dim": config["n_embd"],
        "depth": config["n_layer"],
        "heads": config["n_head"],
        "max_len": config["n_positions"],
        "activation": activation,
    }


def wanted(depth: int) -> dict[str, Wanted]:
    """Where each of the ``gpt`` model's parameters is in a GPT-2 directory's files (ddpkit.models.hf_slices): under
    ``transformer.`` (GPT2LMHeadModel) or not (GPT2Model); the Conv1D weights transposed; the head tied to the
    embedding, whose padded rows are zeros; the position table's first ``max_len`` rows."""
    why = " (GPT2LMHeadModel or GPT2Model)"
    out = {}
    for ours, (theirs, transposed) in _each_name(depth):
        rows = ours in ("embed.weight", "pos.weight")
        out[ours] = Wanted((f"transformer.{theirs}", theirs), transposed=transposed, rows=rows, why=why)
    out["head.weight"] = out["embed.weight"]
    return out


def _each_name(depth: int) -> list[tuple[str, tuple[str, bool]]]:
    pairs = []
    for ours, (theirs, transposed) in _NAMES.items():
        blocks = range(depth) if "{i}" in ours else [None]
        pairs += [(ours.format(i=i), (theirs.format(i=i), transposed)) for i in blocks]
    return pairs


def hf_name(name: str) -> tuple[str, bool] | None:
    """GPT2LMHeadModel's name of a ``gpt`` tensor name and whether it is a transposed Conv1D weight (None: none)."""
    block, _, rest = name.partition(".")
    index, _, leaf = rest.partition(".")
    if block == "blocks" and f"blocks.{{i}}.{leaf}" in _NAMES:
        theirs, transposed = _NAMES[f"blocks.{{i}}.{leaf}"]
        return f"transformer.{theirs.format(i=index)}", transposed
    theirs, transposed = _NAMES.get(name, (None, False))
    return (f"transformer.{theirs}", transposed) if theirs is not None and "{i}" not in name else None


def hf_config(model_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``config.json`` for a ``gpt`` model of these resolved kwargs (its real vocabulary: ``valid_vocab`` if padded)."""
    vocab = model_kwargs.get("valid_vocab") or model_kwargs["vocab_size"]
    eot = (
        50256 if vocab >= 50257 else vocab - 1
    )  # GPT-2's <|endoftext|>; ddpkit's byte tokens end with it too (256 of 257)
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": vocab,
        "n_positions": model_kwargs["max_len"],
        "n_embd": model_kwargs["dim"],
        "n_layer": model_kwargs["depth"],
        "n_head": model_kwargs["heads"],
        "n_inner": None,
        "activation_function": HF_OF_ACTIVATION[model_kwargs.get("activation", "gelu")],
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }


def to_hf(weights: dict[str, torch.Tensor], model_kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A ``gpt`` state_dict as GPT2LMHeadModel's (``transformer.*``; the tied output layer once), padding dropped."""
    vocab = model_kwargs.get("valid_vocab") or model_kwargs["vocab_size"]
    out = {}
    for ours, (theirs, transposed) in _each_name(model_kwargs["depth"]):
        if ours not in weights:
            raise CheckpointError(
                f"the checkpoint's model has no {ours!r}: it is not ddpkit's gpt model (model.name: gpt)"
            )
        tensor = weights[ours].detach().float().cpu()
        out[f"transformer.{theirs}"] = (tensor.t() if transposed else tensor).contiguous()
    out["transformer.wte.weight"] = out["transformer.wte.weight"][:vocab].clone()
    return out
