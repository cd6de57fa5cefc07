"""LoRA and peft: a Hugging Face model's adapter made by peft, and any adapter as the files peft reads.

    model, names = apply_peft(hf_model, LoraConfig(r=8, alpha=16, targets=["q_proj", "v_proj"]))
    tensors, config = peft_files(adapter, lora={"r": 8, ...}, base="models/Qwen2.5-0.5B", hf_name=hf_name)
    # -> adapter_model.safetensors (tensors) and adapter_config.json (config), what PeftModel.from_pretrained loads

A ``transformers.PreTrainedModel`` trained through the generic path (``examples/hf_causal_lm.py``)
gets its adapter from ``peft.get_peft_model`` with ``model.lora``'s keys (``r``, ``alpha`` as
``lora_alpha``, ``dropout`` as ``lora_dropout``, ``targets`` as ``target_modules``; ``all-linear``
is peft's own), so its layers are peft's, and peft's merge and loaders apply. peft is an optional
extra: ``pip install 'ddpkit[peft]'``.

The files peft writes (``PeftModel.save_pretrained``) hold each adapter tensor as
``base_model.model.<the transformers module>.lora_A.weight`` (the adapter's name, ``default``, left
out), and ``adapter_config.json`` the settings. :func:`peft_files` writes the same from either kind
of checkpoint: ddpkit's own model (its names mapped to transformers' by ``hf_name``) or a peft model
(the adapter's name taken out).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ddpkit.config.lora_section import LoraConfig
from ddpkit.errors import CheckpointError, ConfigError

__all__ = ["apply_peft", "peft_files", "PEFT_PREFIX"]

#: What peft puts before a transformers module's name in an adapter file.
PEFT_PREFIX = "base_model.model."


def _peft(purpose: str) -> Any:
    try:
        import peft
    except ImportError:
        raise ConfigError(f"{purpose} needs peft, which is not installed: pip install 'ddpkit[peft]'") from None
    return peft


def apply_peft(model: nn.Module, cfg: LoraConfig) -> tuple[nn.Module, list[str]]:
    """``peft.get_peft_model`` of ``model`` with ``cfg``'s adapter (the base frozen), and the adapted layers' names."""
    peft = _peft("model.lora on a Hugging Face model")
    config = peft.LoraConfig(
        r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=cfg.targets, bias="none"
    )
    try:
        wrapped = peft.get_peft_model(model, config)
    except ValueError as exc:  # peft's "Target modules ... not found in the base model"
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ConfigError(
            f"model.lora.targets: {exc}; the model's linear layers are {', '.join(linear)} (or targets: all-linear)"
        ) from None
    names = [name.removesuffix(".lora_A") for name, _ in wrapped.named_modules() if name.endswith(".lora_A")]
    return wrapped, names


def peft_files(
    adapter: dict[str, torch.Tensor],
    *,
    lora: dict[str, Any],
    base: str | None,
    hf_name: Callable[[str], str | None] | None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(tensors, adapter_config)`` of the adapter tensors of a checkpoint, as ``PeftModel.save_pretrained``
    writes them. ``hf_name`` maps ddpkit's names to transformers' (None: they are a peft model's already)."""
    tensors = {}
    for name, tensor in adapter.items():
        if hf_name is None:
            theirs = name.replace(".default.", ".")
        else:
            mapped = hf_name(name)
            if mapped is None:
                raise CheckpointError(f"the adapter tensor {name!r} has no transformers name; it cannot go to peft")
            theirs = PEFT_PREFIX + mapped
        tensors[theirs] = tensor.detach().float().cpu().contiguous()
    modules = sorted({key.split(".lora_")[0].rsplit(".", 1)[-1] for key in tensors})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": lora["r"],
        "lora_alpha": lora["alpha"],
        "lora_dropout": lora.get("dropout", 0.0),
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }
    return tensors, config
