"""Hugging Face Llama-family directories in and out of ddpkit's model: Llama, Qwen2, Qwen3, Mistral, SmolLM2.

    model: {name: gpt, kwargs: {init_from: models/Qwen2.5-0.5B}}              # shape and weights from the directory
    model: {name: gpt, kwargs: {init_from: models/Mistral-7B-v0.1, max_len: 4096}}   # a window wider than the context
    $ ddpkit export runs/ft out/qwen-ft --format hf                          # and back: config.json + safetensors

A directory is what ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` /
``MistralForCausalLM.save_pretrained`` writes: ``config.json`` and the weights (one file, shards named
by ``model.safetensors.index.json``, or ``pytorch_model.bin``); a tied output layer is absent from the
files and comes from the embedding. Both config layouts are read: transformers 4.x's (``rope_theta``
and ``rope_scaling`` at the top) and 5.x's (both inside ``rope_parameters``).

The weights load as they are: RoPE here is in Hugging Face's layout (ddpkit.models.rope), so
``q_proj`` / ``k_proj`` need no permutation; the names are renamed only (``model.layers.3.self_attn.q_proj``
is ``blocks.3.attn.q_proj``, ``input_layernorm`` is ``attn_norm``, ``post_attention_layernorm`` is
``mlp_norm``, ``lm_head`` is ``head``). What the model does not compute is refused by name: sliding-window
attention narrower than the context, RoPE rules other than default / linear / llama3, activations other
than SiLU. Logits agree with transformers' within 1e-4 in fp32 (tests/test_llama_hf.py).

This module reads and writes plain dicts of tensors and never imports the model or transformers.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

from ddpkit.errors import CheckpointError, ConfigError
from ddpkit.models.hf_files import read_hf_config
from ddpkit.models.hf_slices import Wanted

__all__ = ["read_config", "wanted", "to_hf", "hf_config", "hf_name", "our_name", "ARCHITECTURES"]

#: model_type -> the class transformers builds from the config.json written on export.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}
#: Names inside a block: Hugging Face's -> ddpkit's (the projections keep their names).
_IN_BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm", "self_attn": "attn", "mlp": "mlp"}
_OUTSIDE = {"model.embed_tokens": "embed", "model.norm": "norm", "lm_head": "head"}
_IN_BLOCK_HF = {ours: theirs for theirs, ours in _IN_BLOCK.items()}
_OUTSIDE_HF = {ours: theirs for theirs, ours in _OUTSIDE.items()}
_HF_BLOCK = re.compile(r"^model\.layers\.(\d+)\.([a-z_]+)\.(.+)$")
_OUR_BLOCK = re.compile(r"^blocks\.(\d+)\.([a-z_]+)\.(.+)$")


def our_name(name: str) -> str | None:
    """ddpkit's name for a Hugging Face tensor name (None for one the model has no use for, e.g. ``rotary_emb``)."""
    match = _HF_BLOCK.match(name)
    if match and match.group(2) in _IN_BLOCK:
        return f"blocks.{match.group(1)}.{_IN_BLOCK[match.group(2)]}.{match.group(3)}"
    module, _, leaf = name.rpartition(".")
    return f"{_OUTSIDE[module]}.{leaf}" if module in _OUTSIDE else None


def hf_name(name: str) -> str | None:
    """The Hugging Face name of a ddpkit tensor name (the inverse of :func:`our_name`; None if it has none)."""
    match = _OUR_BLOCK.match(name)
    if match and match.group(2) in _IN_BLOCK_HF:
        return f"model.layers.{match.group(1)}.{_IN_BLOCK_HF[match.group(2)]}.{match.group(3)}"
    module, _, leaf = name.rpartition(".")
    return f"{_OUTSIDE_HF[module]}.{leaf}" if module in _OUTSIDE_HF else None


def _rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """``(theta, scaling)`` from 5.x's ``rope_parameters``, or from 4.x's ``rope_theta`` and ``rope_scaling``."""
    parameters = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = parameters.pop("rope_theta", config.get("rope_theta", 10000.0))
    rule = parameters.get("rope_type", parameters.get("type", "default"))
    if rule == "llama3":
        parameters.setdefault("original_max_position_embeddings", config["max_position_embeddings"])
    if config.get("partial_rotary_factor") is not None:
        parameters.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    return float(theta), (parameters if rule != "default" or "partial_rotary_factor" in parameters else None)


def _window(config: dict[str, Any]) -> int | None:
    """The sliding-window width some layers attend within (None: every layer attends to the whole context)."""
    if "sliding_attention" in (config.get("layer_types") or []):
        return config.get("sliding_window")
    if config["model_type"] in ("qwen2", "qwen3"):
        return config.get("sliding_window") if config.get("use_sliding_window") else None
    return config.get("sliding_window")


def read_config(directory: str | os.PathLike) -> tuple[dict[str, Any], int | None]:
    """The Llama-family kwargs (``LlamaShape``'s names) of the model in ``directory``, and its sliding window."""
    path = Path(directory) / "config.json"
    config = read_hf_config(directory)
    family = config.get("model_type")
    if family not in ARCHITECTURES:
        raise ConfigError(f"model.kwargs.init_from: {path} is a {family!r} model, not one of the Llama family")
    if config.get("hidden_act", "silu") != "silu":
        raise ConfigError(
            f"model.kwargs.init_from: {path}: hidden_act {config['hidden_act']!r}; the Llama family's MLP is SwiGLU "
            "(silu); train this model through examples/hf_causal_lm.py"
        )
    theta, scaling = _rope(config)
    heads = config["num_attention_heads"]
    attention_bias = bool(config.get("attention_bias", False))
    kwargs = {
        "vocab_size": config["vocab_size"],
        "dim": config["hidden_size"],
        "depth": config["num_hidden_layers"],
        "heads": heads,
        "kv_heads": config.get("num_key_value_heads") or heads,
        "head_dim": config.get("head_dim") or config["hidden_size"] // heads,
        "mlp_dim": config["intermediate_size"],
        "max_len": config["max_position_embeddings"],
        "norm_eps": config.get("rms_norm_eps", 1e-6),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "qkv_bias": family == "qwen2" or attention_bias,
        "out_bias": family != "qwen2" and attention_bias,
        "mlp_bias": bool(config.get("mlp_bias", False)),
        "qk_norm": family == "qwen3",
        "tied": bool(config.get("tie_word_embeddings", False)),
        "family": family,
    }
    return kwargs, _window(config)


def check_window(window: int | None, *, max_len: int, source: str) -> None:
    """Refuse a sliding window narrower than the context: the model attends to the whole context."""
    if window is not None and window < max_len:
        raise ConfigError(
            f"model.kwargs.init_from: {source} attends within a sliding window of {window:,} tokens, narrower than "
            f"its context of {max_len:,}; ddpkit's model has no sliding-window attention: set model.kwargs.max_len "
            f"to {window:,} or less (within the window the two are the same), or train it through "
            "examples/hf_causal_lm.py"
        )


def wanted(names: list[str], *, tied: bool) -> dict[str, Wanted]:
    """Where each of the model's parameters ``names`` is in the directory's files (ddpkit.models.hf_slices): renamed
    only; a tied head is the embedding; a padded vocabulary's rows past the file's are zeros."""
    out = {}
    for name in names:
        theirs = hf_name("embed.weight" if tied and name == "head.weight" else name)
        if theirs is None:
            raise CheckpointError(f"the model has {name!r}: it is not ddpkit's Llama-family model")
        why = " (tie_word_embeddings is false: lm_head.weight is needed)" if name == "head.weight" else ""
        out[name] = Wanted((theirs,), rows=name in ("embed.weight", "head.weight"), why=why)
    return out


def hf_config(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``config.json`` for a model of these resolved ``LlamaShape`` kwargs, in a layout transformers 4.x and 5.x read.

    ``rope_theta`` / ``rope_scaling`` at the top (4.x) and ``rope_parameters`` (5.x) are both written;
    the vocabulary is the real one (``valid_vocab`` when padded)."""
    family = kwargs["family"]
    scaling = kwargs["rope_scaling"]
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[family]],
        "model_type": family,
        "vocab_size": kwargs.get("valid_vocab") or kwargs["vocab_size"],
        "hidden_size": kwargs["dim"],
        "intermediate_size": kwargs["mlp_dim"],
        "num_hidden_layers": kwargs["depth"],
        "num_attention_heads": kwargs["heads"],
        "num_key_value_heads": kwargs["kv_heads"],
        "head_dim": kwargs["head_dim"],
        "hidden_act": "silu",
        "max_position_embeddings": kwargs["max_len"],
        "rms_norm_eps": kwargs["norm_eps"],
        "rope_theta": kwargs["rope_theta"],
        "rope_scaling": scaling,
        "rope_parameters": {"rope_type": "default", **(scaling or {}), "rope_theta": kwargs["rope_theta"]},
        "tie_word_embeddings": kwargs["tied"],
        "attention_dropout": 0.0,
        "torch_dtype": "float32",
    }
    config.update(_family_fields(kwargs))
    return config


def _family_fields(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The config.json keys that differ by family: biases, and windows switched off."""
    family = kwargs["family"]
    if family == "qwen2":
        if not kwargs["qkv_bias"] or kwargs["out_bias"] or kwargs["mlp_bias"] or kwargs["qk_norm"]:
            raise CheckpointError(_not_exportable(kwargs, "qwen2 has biases on q/k/v only and no q/k norm"))
        return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": kwargs["depth"]}
    if kwargs["qkv_bias"] != kwargs["out_bias"]:
        raise CheckpointError(_not_exportable(kwargs, f"{family}'s attention_bias is on q/k/v and o_proj together"))
    fields: dict[str, Any] = {"attention_bias": kwargs["qkv_bias"]}
    if family == "qwen3":
        if not kwargs["qk_norm"] or kwargs["mlp_bias"]:
            raise CheckpointError(_not_exportable(kwargs, "qwen3 has q/k norms and no MLP bias"))
        return {**fields, "use_sliding_window": False, "sliding_window": None, "max_window_layers": kwargs["depth"]}
    if kwargs["qk_norm"]:
        raise CheckpointError(_not_exportable(kwargs, f"{family} has no q/k norm (qwen3 has)"))
    if family == "mistral":
        if kwargs["mlp_bias"]:
            raise CheckpointError(_not_exportable(kwargs, "mistral has no MLP bias"))
        return {**fields, "sliding_window": None}
    return {**fields, "mlp_bias": kwargs["mlp_bias"]}


def _not_exportable(kwargs: dict[str, Any], why: str) -> str:
    return (
        f"model.kwargs.family: {kwargs['family']!r} cannot describe this model ({why}); set model.kwargs.family to "
        "the family whose options it has (llama: attention_bias on q/k/v/o and mlp_bias; qwen2: q/k/v biases; "
        "qwen3: q/k norms)"
    )


def to_hf(weights: dict[str, torch.Tensor], kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A state_dict of the model as the Hugging Face model's: renamed, fp32, the padding cut, a tied head left out."""
    vocab = kwargs.get("valid_vocab") or kwargs["vocab_size"]
    out = {}
    for name, tensor in weights.items():
        if name == "head.weight" and kwargs["tied"]:
            continue
        theirs = hf_name(name)
        if theirs is None:
            raise CheckpointError(f"the checkpoint's model has {name!r}: it is not ddpkit's Llama-family model")
        tensor = tensor.detach().float().cpu()
        if name in ("embed.weight", "head.weight"):
            tensor = tensor[:vocab]
        out[theirs] = tensor.contiguous().clone()
    return out
