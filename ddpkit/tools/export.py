"""``ddpkit export CHECKPOINT OUT``: a checkpoint's model weights for inference, as safetensors or a torch state_dict.

    $ ddpkit export runs/mnist/checkpoints model.safetensors   # newest valid checkpoint; safetensors by the extension
    $ ddpkit export runs/lm/checkpoints/step-400.dcp model.pt  # a sharded (DCP) checkpoint: every rank's shards joined

The format follows OUT's extension: ``.safetensors`` (``pip install 'ddpkit[safetensors]'``; loaded by
mmap and never unpickled: what the Hugging Face side expects) or anything else for ``torch.save``'s
plain ``state_dict``. Either way the keys are the bare model's (no ``module.`` / ``_orig_mod.``)
and the tensors equal the checkpoint's bit for bit. safetensors stores no shared storage, so
tensors that share it (tied input and output embeddings) are written as separate copies under
every name, as ``model.pt`` has them, and non-contiguous ones are made contiguous. The file is
written atomically; the metadata names the checkpoint and its step. A LoRA run's checkpoint holds
the adapter only (``model.lora``): that is what is written, its base's fingerprint in the metadata
(``extra_state``); ``--format peft`` and ``--format hf --merge`` (:mod:`ddpkit.tools.hf_export`) write
it for peft and transformers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from ddpkit.atomic import write_atomically
from ddpkit.checkpoint.files import load_checkpoint, save_atomically, validate_checkpoint
from ddpkit.checkpoint.sharded import export_model, is_sharded_checkpoint
from ddpkit.distributed.ddp import strip_wrapper_prefixes
from ddpkit.errors import CheckpointError, DdpkitError

__all__ = ["export", "model_weights", "save_safetensors"]


def export(checkpoint: str | os.PathLike, output: str | os.PathLike) -> str:
    """Write the model weights of ``checkpoint`` (a file, a DCP directory, or a directory: its newest valid) to
    ``output``; the summary line."""
    info = validate_checkpoint(checkpoint)
    weights, source = model_weights(info.path)
    if Path(output).suffix == ".safetensors":
        metadata = {"source": str(info.path), "step": str(info.step)}
        # a module's extra state (a LoRA adapter's base fingerprint) is not a tensor: it goes to the metadata
        extra = {key: weights.pop(key) for key in [k for k in weights if k.endswith("._extra_state")]}
        if extra:
            metadata["extra_state"] = json.dumps(extra)
        save_safetensors(weights, output, metadata=metadata)
    else:
        save_atomically(weights, output)
    return f"wrote {output}: {len(weights)} tensors from {source} (step {info.step})"


def model_weights(path: Path) -> tuple[dict[str, Any], str]:
    """The bare model's state_dict stored in the checkpoint at ``path``, and how to name where it came from."""
    if is_sharded_checkpoint(path):  # a DCP directory (parallel.mode zero1 / fsdp2): every rank's shards joined
        return export_model(path), f"the DCP directory {path}"
    state = load_checkpoint(path)
    if "model" not in state:
        raise CheckpointError(f"{path} has no 'model' entry; is it a ddpkit checkpoint?")
    return strip_wrapper_prefixes(state["model"]), str(path)  # a file written elsewhere may carry the prefixes


def save_safetensors(
    weights: dict[str, Any], output: str | os.PathLike, *, metadata: dict[str, str] | None = None
) -> None:
    """``weights`` as one safetensors file: contiguous CPU tensors, shared storage written as separate copies."""
    try:
        from safetensors.torch import save
    except ImportError:
        raise DdpkitError(
            f"writing {output} needs the safetensors package, which is not installed: "
            "pip install 'ddpkit[safetensors]' (or export to a .pt file)"
        ) from None
    tensors = {}
    seen = set()
    for key, value in weights.items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(
                f"the model's state_dict entry {key!r} is a {type(value).__name__}, not a tensor; "
                "safetensors holds tensors only: export to a .pt file instead"
            )
        tensor = value.detach().cpu()
        storage = tensor.untyped_storage().data_ptr() if tensor.numel() else None
        if storage in seen or not tensor.is_contiguous():  # a tied weight's second name, or a strided view
            tensor = tensor.contiguous().clone()
        seen.add(storage)
        tensors[key] = tensor
    write_atomically(output, save(tensors, metadata={"format": "pt", **(metadata or {})}), durable=True)
