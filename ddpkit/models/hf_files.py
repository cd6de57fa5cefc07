"""The files of a Hugging Face model directory, as ``save_pretrained`` writes them: ``config.json`` and the weights.

    config = read_hf_config("models/Qwen2.5-0.5B")          # the parsed config.json (a ConfigError if absent)
    family_of("models/gpt2")                                 # its model_type: "gpt2", "llama", "qwen2", ...

The weights are ``model.safetensors``, or shards named by ``model.safetensors.index.json``
(``save_pretrained(max_shard_size=...)``), or ``pytorch_model.bin``; :mod:`ddpkit.models.hf_slices` reads them a
held slice at a time, where each family (:mod:`ddpkit.models.hf_gpt2`, :mod:`ddpkit.models.hf_llama`) says each
parameter is. Nothing is downloaded, and ``transformers`` is not needed: only ``safetensors`` for safetensors files.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from ddpkit.errors import ConfigError

__all__ = [
    "read_hf_config",
    "family_of",
    "safetensors_torch",
    "check_against",
    "special_tokens",
    "copy_tokenizer",
    "TOKENIZER_FILES",
]

#: config.json keys copied from ``init_from``'s own config.json on export: the special tokens generation stops at.
SPECIAL_TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")

#: Files of a tokenizer that travel with a model directory (copied by ``ddpkit export --format hf``).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


def read_hf_config(directory: str | os.PathLike) -> dict[str, Any]:
    """``directory/config.json``, parsed; a ConfigError naming ``model.kwargs.init_from`` when there is none."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"model.kwargs.init_from: {directory} has no config.json; give a directory written by "
            "save_pretrained (config.json + model.safetensors), e.g. a local copy of the model"
        )
    return json.loads(path.read_text())


def family_of(directory: str | os.PathLike) -> str | None:
    """The ``model_type`` of the directory's config.json (None when it names none)."""
    return read_hf_config(directory).get("model_type")


def safetensors_torch(purpose: str) -> Any:
    """``safetensors.torch``, imported on first use; one line naming the extra when it is missing."""
    try:
        import safetensors.torch
    except ImportError:
        raise ConfigError(
            f"{purpose} needs the safetensors package, which is not installed: pip install 'ddpkit[safetensors]'"
        ) from None
    return safetensors.torch


def check_against(shape: dict[str, Any], given: dict[str, Any], *, source: str) -> None:
    """Explicit kwargs must agree with a pretrained shape: equal, or a larger (padded) vocabulary, a shorter context."""
    rules = {
        "vocab_size": ("at least", lambda ours, theirs: ours >= theirs),
        "max_len": ("at most", lambda ours, theirs: ours <= theirs),
    }
    for key, value in given.items():
        if key not in shape:
            continue
        rule, allowed = rules.get(key, ("equal to", lambda ours, theirs: ours == theirs))
        if not allowed(value, shape[key]):
            raise ConfigError(
                f"model.kwargs.{key}: {value!r} contradicts {source}, whose model has {shape[key]!r} "
                f"(it must be {rule} that); drop model.kwargs.{key}"
            )


def special_tokens(init_from: str | None) -> dict[str, Any]:
    """The special-token ids of ``init_from``'s config.json, when it is there to read."""
    path = Path(init_from) / "config.json" if init_from else None
    if path is None or not path.is_file():
        return {}
    config = json.loads(path.read_text())
    return {key: config[key] for key in SPECIAL_TOKEN_KEYS if key in config}


def copy_tokenizer(init_from: str | None, output: Path) -> list[str]:
    """Copy the tokenizer's files of ``init_from`` (those it has) into ``output``; their names."""
    if not init_from or Path(init_from).resolve() == output.resolve():
        return []
    copied = []
    for name in TOKENIZER_FILES:
        if (Path(init_from) / name).is_file():
            shutil.copyfile(Path(init_from) / name, output / name)
            copied.append(name)
    return copied
