"""``ddpkit export RUN_OR_CHECKPOINT OUT_DIR --format hf``: a ``gpt`` model as a Hugging Face directory.

    $ ddpkit export runs/ft out/gpt2-ft --format hf          # a run: its model.pt (else its newest checkpoint)
    $ ddpkit export runs/ft/checkpoints/step-400.dcp out/ft --format hf   # an fsdp2 checkpoint, shards joined
    >>> AutoModelForCausalLM.from_pretrained("out/ft")        # the same logits as the ddpkit model

GPT-2 (``arch: gpt2``) becomes a ``GPT2LMHeadModel`` directory (``Conv1D`` weights transposed back,
the tied output layer stored once); the Llama family (``arch: llama``) a ``LlamaForCausalLM``,
``Qwen2ForCausalLM``, ``Qwen3ForCausalLM`` or ``MistralForCausalLM`` one, by the model's ``family``
(the ``model_type`` of the directory it was loaded from), a tied head left out as
``save_pretrained`` leaves it out. OUT_DIR gets ``config.json`` (the real vocabulary: a padded one is
cut back to ``valid_vocab`` ids) and ``model.safetensors``, each written atomically, and the
tokenizer's files (``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json``, ...)
copied from ``init_from`` when it has them, so the directory is complete for transformers, vLLM or
TRL. A directory ``init_from`` loaded comes back out with its weights equal, bit for bit.

"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ddpkit.atomic import write_atomically
from ddpkit.errors import CheckpointError
from ddpkit.models import hf_gpt2, hf_llama
from ddpkit.models.gpt import resolve
from ddpkit.models.hf_files import copy_tokenizer, special_tokens
from ddpkit.models.lora import adapter_of
from ddpkit.models.lora_peft import peft_files
from ddpkit.tools.export import save_safetensors
from ddpkit.tools.lm_source import ModelSpec, merged_weights, read_model

__all__ = ["export_hf", "export_peft", "write_hf_directory"]


def export_hf(source: str | os.PathLike, output: str | os.PathLike, *, merge: bool = False) -> str:
    """Write the ``gpt`` model of ``source`` (a run directory or a checkpoint) as a Hugging Face directory; say what.
    ``merge``: a LoRA run's adapter merged into its base (required for a LoRA run, refused for another)."""
    spec = read_model(source)
    if spec.name != "gpt":
        raise CheckpointError(
            f"{spec.source}: --format hf writes ddpkit's gpt model (GPT-2 or the Llama family), but this run's "
            f"model is {spec.name!r}; export it as .safetensors or .pt instead"
            + (", or its adapter with --format peft" if spec.lora else "")
        )
    if (spec.lora is not None) != merge:
        raise CheckpointError(
            f"{spec.source}: the run trained a LoRA adapter (model.lora): write it merged into its base with "
            "--format hf --merge, or the adapter alone with --format peft"
            if spec.lora is not None
            else f"{spec.source}: --merge merges a LoRA adapter, but this run trained every parameter; drop --merge"
        )
    weights = merged_weights(spec) if merge else spec.weights
    line = write_hf_directory(spec, weights, Path(output))
    return line.replace(" from ", " (LoRA merged in fp32) from ", 1) if merge else line


def export_peft(source: str | os.PathLike, output: str | os.PathLike) -> str:
    """Write the LoRA adapter of ``source`` as ``adapter_model.safetensors`` + ``adapter_config.json``; say what."""
    spec = read_model(source, named=False)
    if spec.lora is None:
        raise CheckpointError(
            f"{spec.source}: --format peft writes a LoRA adapter, but this run has no model.lora; use --format hf"
        )
    adapter, base = adapter_of(spec.weights)
    if spec.name == "gpt" and resolve(spec.kwargs)[0] != "llama":
        raise CheckpointError(
            f"{spec.source}: peft's names exist for the Llama family here; write GPT-2's adapter merged with "
            "--format hf --merge"
        )
    hf_name = hf_llama.hf_name if spec.name == "gpt" else None
    where = spec.kwargs.get("init_from") or spec.kwargs.get("pretrained") or (base or {}).get("base")
    tensors, config = peft_files(adapter, lora=spec.lora, base=where, hf_name=hf_name)
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    save_safetensors(tensors, output / "adapter_model.safetensors", metadata={"source": spec.source})
    write_atomically(output / "adapter_config.json", json.dumps(config, indent=2) + "\n", durable=True)
    targets = ", ".join(config["target_modules"])
    what = f"{len(tensors)} tensors, r={config['r']} on {targets}"
    return f"wrote {output}: adapter_config.json + adapter_model.safetensors ({what}) from {spec.source}"


def write_hf_directory(spec: ModelSpec, weights: dict[str, Any], output: Path) -> str:
    """``config.json``, ``model.safetensors`` and the tokenizer's files of the ``gpt`` model ``spec`` in ``output``."""
    arch, kwargs = resolve(spec.kwargs)
    if arch == "llama":
        tensors = hf_llama.to_hf(weights, kwargs)
        config = hf_llama.hf_config(kwargs)
        shape = f"{hf_llama.ARCHITECTURES[kwargs['family']]} {kwargs['depth']} x {kwargs['dim']}"
    else:
        tensors = hf_gpt2.to_hf(weights, kwargs)
        config = hf_gpt2.hf_config(kwargs)
        shape = f"GPT-2 {kwargs['depth']} x {kwargs['dim']}"
    init_from = spec.kwargs.get("init_from")
    config.update(special_tokens(init_from))
    output.mkdir(parents=True, exist_ok=True)
    save_safetensors(tensors, output / "model.safetensors", metadata={"source": spec.source})
    write_atomically(output / "config.json", json.dumps(config, indent=2) + "\n", durable=True)
    copied = copy_tokenizer(init_from, output)
    extra = f" + {len(copied)} tokenizer files" if copied else ""
    return (
        f"wrote {output}: config.json + model.safetensors ({len(tensors)} tensors, {shape}){extra} from {spec.source}"
    )
