"""A trained language model back from disk: a run directory or a checkpoint, as ``export --format hf`` and
``generate`` take it.

    model, source = load_model("runs/ft")                        # runs/ft/model.pt, else its newest checkpoint
    model, source = load_model("runs/ft/checkpoints/step-400.dcp")   # a sharded (fsdp2 / zero1) checkpoint, joined
    spec = read_model("runs/ft")                                  # the model section and the bare weights, unbuilt

The model section comes from the run's saved config (``config.yaml``, or the checkpoint's own copy),
the weights from ``model.pt`` or the checkpoint. The built-in ``gpt`` is rebuilt from its kwargs
without loading ``init_from`` again (its weights are the checkpoint's); any other model is built by
its registered name, as the Trainer built it. A LoRA run (``model.lora``) holds the adapter only:
its base is built as the Trainer built it (``init_from``'s weights read again), the adapter added
and loaded, and the base's fingerprint checked (a base changed since training is refused naming both).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from ddpkit.checkpoint.files import load_checkpoint, validate_checkpoint
from ddpkit.checkpoint.sharded_run import read_any
from ddpkit.config.lora_section import LoraConfig
from ddpkit.config.schema import ModelConfig
from ddpkit.errors import CheckpointError, ConfigError
from ddpkit.models.gpt import build_gpt
from ddpkit.models.lora import apply_lora, merge_lora
from ddpkit.registry import build_model
from ddpkit.tools.export import model_weights

__all__ = ["ModelSpec", "read_model", "load_model", "build_bare", "merged_weights"]


@dataclass(frozen=True)
class ModelSpec:
    """What a run or checkpoint holds of its model: the config's ``model`` section, the weights, their origin."""

    name: str | None
    kwargs: dict[str, Any]
    weights: dict[str, Any]
    source: str
    #: ``model.lora`` of the run (None: every parameter was trained and is in ``weights``).
    lora: dict[str, Any] | None = None

    @property
    def config(self) -> ModelConfig:
        """The model section as the Trainer read it."""
        return ModelConfig(name=self.name, kwargs=self.kwargs, lora=LoraConfig(**self.lora) if self.lora else None)


def read_model(path: str | os.PathLike, *, named: bool = True) -> ModelSpec:
    """The model of a run directory (``model.pt`` + ``config.yaml``; else its newest checkpoint) or a checkpoint;
    ``named``: refuse a run whose config names no model (it cannot be rebuilt)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(
            f"{path}: no such run directory or checkpoint; give a run's output_dir (e.g. runs/lm_tiny), "
            "a checkpoint file or a checkpoint directory"
        )
    if path.is_dir() and (path / "model.pt").is_file() and (path / "config.yaml").is_file():
        section = (yaml.safe_load((path / "config.yaml").read_text()) or {}).get("model") or {}
        return _spec(section, load_checkpoint(path / "model.pt"), str(path / "model.pt"), named=named)
    if path.is_dir() and (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    info = validate_checkpoint(path)
    weights, source = model_weights(info.path)
    section = (read_any(str(info.path)).get("config") or {}).get("model") or {}
    return _spec(section, weights, f"{source} (step {info.step})", named=named)


def _spec(section: dict[str, Any], weights: dict[str, Any], source: str, *, named: bool) -> ModelSpec:
    if named and not section.get("name"):
        raise CheckpointError(f"{source}: the run's config names no model (model.name), so it cannot be rebuilt here")
    kwargs = dict(section.get("kwargs") or {})
    return ModelSpec(section.get("name"), kwargs, weights, source, lora=section.get("lora"))


def build_bare(spec: ModelSpec) -> torch.nn.Module:
    """The model of ``spec`` built with its initial weights (``gpt``: without reading ``init_from``'s weights); a
    LoRA run's: its base as trained on, with the adapter (:func:`ddpkit.models.lora.apply_lora`)."""
    if spec.lora is not None:
        base = build_gpt(spec.kwargs) if spec.name == "gpt" else build_model(spec.config)
        return apply_lora(base, spec.config)
    if spec.name == "gpt":
        return build_gpt(spec.kwargs, weights=False)
    return build_model(spec.config)


def merged_weights(spec: ModelSpec) -> dict[str, torch.Tensor]:
    """A LoRA run's model with its adapter merged into the base (``W + alpha / r * B @ A`` in fp32), as a plain
    state_dict of the model without an adapter."""
    model = build_bare(spec)
    model.load_state_dict(spec.weights)
    return merge_lora(model).state_dict()


def load_model(path: str | os.PathLike, *, device: str | torch.device = "cpu") -> tuple[torch.nn.Module, ModelSpec]:
    """The model of a run or checkpoint with its trained weights, in eval mode on ``device``."""
    spec = read_model(path)
    model = build_bare(spec)
    model.load_state_dict(spec.weights)
    return model.to(device).eval(), spec
