"""Command-line overrides: ``dotted.key=value`` strings applied on top of the raw config.

    keys, value = parse_override("optim.lr=0.1")      # (["optim", "lr"], 0.1)

The value is parsed as a YAML scalar (``3`` is an int, ``true`` a bool, ``null`` None,
``[1, 2]`` a list, ``3e-4`` a number as in the file: :func:`ddpkit.config.yaml_text.parse_yaml`). Precedence: overrides > file > defaults.
"""

from __future__ import annotations

from typing import Any

from ddpkit.config.yaml_text import first_clause, parse_yaml, short_repr
from ddpkit.errors import ConfigError

__all__ = ["parse_override", "apply_override"]


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``"a.b=value"`` into (``["a", "b"]``, parsed value). Raises ConfigError if malformed."""
    import yaml

    key, sep, value_text = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"bad override {short_repr(text)}: expected dotted.key=value, e.g. optim.lr=0.1")
    try:
        value = parse_yaml(value_text) if value_text.strip() else None
    except (yaml.YAMLError, RecursionError):
        raise ConfigError(f"bad override {short_repr(text)}: the value is not a YAML value; quote it if it is a string") from None
    except (ValueError, OverflowError) as exc:  # see read_yaml
        raise ConfigError(f"bad override {short_repr(text)}: the value cannot be converted ({first_clause(exc)})") from None
    return key.split("."), value


def apply_override(raw: dict[str, Any], text: str, problems: list[str]) -> None:
    try:
        keys, value = parse_override(text)
    except ConfigError as exc:
        problems.append(str(exc))
        return
    node = raw
    for depth, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            path = ".".join(keys[: depth + 1])
            problems.append(f"bad override {short_repr(text)}: {path} is {short_repr(child)}, not a section with sub-keys")
            return
        node = child
    node[keys[-1]] = value
