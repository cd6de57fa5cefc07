"""Command-line overrides: ``dotted.key=value`` strings applied on top of the raw config.

    keys, value = parse_override("optim.lr=0.1")      # (["optim", "lr"], 0.1)

The value is parsed as a YAML scalar (``3`` is an int, ``true`` a bool, ``null`` None,
``[1, 2]`` a list, ``3e-4`` a number as in the file: :func:`ddpkit.config.yaml_text.parse_yaml`).
Precedence: overrides > file > defaults.

A key given twice (``optim.lr=0.1 ... optim.lr=0.2``), or a section given whole and a key inside it
(``optim={lr: 1} optim.lr=2``), is refused by :func:`apply_overrides` naming both positions: which
one the user meant cannot be known, and the file's duplicate keys are refused the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ddpkit.config.yaml_text import DuplicateKeyError, first_clause, parse_yaml, short_repr
from ddpkit.errors import ConfigError

__all__ = ["parse_override", "apply_override", "apply_overrides", "repeated_overrides"]


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``"a.b=value"`` into (``["a", "b"]``, parsed value). Raises ConfigError if malformed."""
    import yaml

    key, sep, value_text = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"bad override {short_repr(text)}: expected dotted.key=value, e.g. optim.lr=0.1")
    try:
        value = parse_yaml(value_text) if value_text.strip() else None
    except DuplicateKeyError as exc:
        keys = ", ".join(f"`{path}`" for path, _, _ in exc.duplicates)
        raise ConfigError(
            f"bad override {short_repr(text)}: the value gives {keys} twice; give each key once"
        ) from None
    except (yaml.YAMLError, RecursionError):
        raise ConfigError(
            f"bad override {short_repr(text)}: the value is not a YAML value; quote it if it is a string"
        ) from None
    except (ValueError, OverflowError) as exc:  # see read_yaml
        raise ConfigError(
            f"bad override {short_repr(text)}: the value cannot be converted ({first_clause(exc)})"
        ) from None
    return key.split("."), value


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str], problems: list[str]) -> None:
    """Apply every override in order, after refusing keys given twice (:func:`repeated_overrides`)."""
    repeats = repeated_overrides(overrides)
    if repeats:
        problems.extend(repeats)
        return
    for text in overrides:
        apply_override(raw, text, problems)


def repeated_overrides(overrides: Sequence[str]) -> list[str]:
    """One problem per pair of overrides that set the same key, or a section and a key inside it.

    Positions are 1-based among the overrides: ``"override 1 (optim.lr=0.1) and override 3
    (optim.lr=0.2) both set optim.lr; give it once"``. Malformed overrides are left to
    :func:`parse_override`.
    """
    first: dict[tuple[str, ...], tuple[int, str]] = {}
    problems = []
    for position, text in enumerate(overrides, start=1):
        key, sep, _ = text.partition("=")
        parts = tuple(part.strip() for part in key.strip().split("."))
        if not sep or not all(parts):
            continue
        for length in range(1, len(parts) + 1):
            earlier = first.get(parts[:length])
            if earlier is not None and (length == len(parts) or earlier[1] == "whole"):
                where = ".".join(parts[:length])
                problems.append(
                    f"override {earlier[0]} ({short_repr(overrides[earlier[0] - 1])}) and override {position} "
                    f"({short_repr(text)}) both set {where}; give each key once"
                )
                break
        else:
            for length in range(1, len(parts)):
                first.setdefault(parts[:length], (position, "prefix"))
            first[parts] = (position, "whole")
    return problems


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
            problems.append(
                f"bad override {short_repr(text)}: {path} is {short_repr(child)}, not a section with sub-keys"
            )
            return
        node = child
    node[keys[-1]] = value
