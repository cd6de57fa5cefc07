"""A trained language model back from disk: a run directory or a checkpoint, as ``export --format hf`` and
``generate`` take it.

    model, source = load_model("runs/ft")                        # runs/ft/model.pt, else its newest checkpoint
    model, source = load_model("runs/ft/checkpoints/step-400.dcp")   # a sharded (fsdp2 / zero1) checkpoint, joined
    spec = read_model("runs/ft")                                  # the model section and the bare weights, unbuilt

The model section comes from the run's saved config (``config.yaml``, or the checkpoint's own copy),
the weights from ``model.pt`` or the checkpoint. The built-in ``gpt`` is rebuilt from its kwargs
without loading ``init_from`` again (its weights are the checkpoint's); any other model is built by
its registered name, as the Trainer built it.
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
from ddpkit.config.schema import ModelConfig
from ddpkit.errors import CheckpointError, ConfigError
from ddpkit.registry import build_model
from ddpkit.tools.export import model_weights
from ddpkit.training.gpt import build_gpt

__all__ = ["ModelSpec", "read_model", "load_model", "build_bare"]


@dataclass(frozen=True)
class ModelSpec:
    """What a run or checkpoint holds of its model: the config's ``model`` section, the weights, their origin."""

    name: str
    kwargs: dict[str, Any]
    weights: dict[str, Any]
    source: str


def read_model(path: str | os.PathLike) -> ModelSpec:
    """The model of a run directory (``model.pt`` + ``config.yaml``; else its newest checkpoint) or a checkpoint."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(
            f"{path}: no such run directory or checkpoint; give a run's output_dir (e.g. runs/lm_tiny), "
            "a checkpoint file or a checkpoint directory"
        )
    if path.is_dir() and (path / "model.pt").is_file() and (path / "config.yaml").is_file():
        section = (yaml.safe_load((path / "config.yaml").read_text()) or {}).get("model") or {}
        return _spec(section, load_checkpoint(path / "model.pt"), str(path / "model.pt"))
    if path.is_dir() and (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    info = validate_checkpoint(path)
    weights, source = model_weights(info.path)
    section = (read_any(str(info.path)).get("config") or {}).get("model") or {}
    return _spec(section, weights, f"{source} (step {info.step})")


def _spec(section: dict[str, Any], weights: dict[str, Any], source: str) -> ModelSpec:
    if not section.get("name"):
        raise CheckpointError(f"{source}: the run's config names no model (model.name), so it cannot be rebuilt here")
    return ModelSpec(section["name"], dict(section.get("kwargs") or {}), weights, source)


def build_bare(spec: ModelSpec) -> torch.nn.Module:
    """The model of ``spec`` built with its initial weights (``gpt``: without reading ``init_from``'s weights)."""
    if spec.name == "gpt":
        return build_gpt(spec.kwargs, weights=False)
    return build_model(ModelConfig(name=spec.name, kwargs=spec.kwargs))


def load_model(path: str | os.PathLike, *, device: str | torch.device = "cpu") -> tuple[torch.nn.Module, ModelSpec]:
    """The model of a run or checkpoint with its trained weights, in eval mode on ``device``."""
    spec = read_model(path)
    model = build_bare(spec)
    model.load_state_dict(spec.weights)
    return model.to(device).eval(), spec
