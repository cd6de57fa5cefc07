"""A resolved config as plain data: dicts for YAML and JSON, its YAML text, a stable hash, flat keys.

config_to_dict(cfg)["optim"]["lr"]     # plain dicts keyed by YAML names
dump_config(cfg)                        # YAML text that load_config reads back to the same config
config_hash(cfg)                        # 16 hex digits, the same on every rank for the same config
flatten({"optim": {"lr": 0.1}})         # {"optim.lr": 0.1}: for diffs and trackers' params
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from ddpkit.config.schema import Config, yaml_key
from ddpkit.config.yaml_text import dump_yaml

__all__ = ["config_to_dict", "as_written", "dump_config", "config_hash", "flatten"]


def config_to_dict(cfg: Any) -> Any:
    """A config (or any part of it) as plain dicts keyed by YAML names, ready for YAML or JSON."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {yaml_key(f): config_to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, dict):
        return {k: config_to_dict(v) for k, v in cfg.items()}
    if isinstance(cfg, (list, tuple)):
        return [config_to_dict(v) for v in cfg]
    return cfg


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML text (loadable again by :func:`load_config` to an equal config)."""
    return dump_yaml(as_written(cfg))


def as_written(cfg: Config) -> dict[str, Any]:
    """The config as a user would write it: plain dicts, without fields other fields derive.

    ``data.batch_size`` is left out when ``data.global_batch_size`` is set (the per-rank batch
    then follows from the world size, and writing both is an error), so the result loads again.
    """
    plain = config_to_dict(cfg)
    if cfg.data.global_batch_size is not None:
        del plain["data"]["batch_size"]
    return plain


def config_hash(cfg: Config | Mapping[str, Any]) -> str:
    """A short, stable hash of a resolved config (same config -> same hash, on every rank)."""
    plain = cfg if isinstance(cfg, Mapping) else config_to_dict(cfg)
    text = json.dumps(_canonical(plain), default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _canonical(value: Any) -> Any:
    """``value`` with every mapping as a list of ``[repr(key), value]`` pairs sorted by key.

    ``json.dumps(sort_keys=True)`` cannot sort a mapping whose keys mix types, which YAML allows
    inside free-form ``kwargs`` (``{0: a, b: c}``).
    """
    if isinstance(value, Mapping):
        return sorted([repr(k), _canonical(v)] for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    return value


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (for diffs of two configs)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, path + "."))
        else:
            out[path] = value
    return out
