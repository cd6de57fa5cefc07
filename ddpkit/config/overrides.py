"""Command-line overrides: ``dotted.key=value`` strings applied on top of the raw config, in order.

    keys, value = parse_override("optim.lr=0.1")      # (["optim", "lr"], 0.1)
    apply_overrides(raw, ["optim.name=adamw", "~optim.momentum"], problems)   # momentum back to its default

The value is parsed as a YAML scalar (``3`` is an int, ``true`` a bool, ``null`` None,
``[1, 2]`` a list, ``3e-4`` a number as in the file: :func:`ddpkit.config.yaml_text.parse_yaml`).
Precedence: overrides > file > defaults.

Overrides apply in the order given and the last one wins, as in Hydra: a wrapper script may append
``train.epochs=40`` to a fixed list that already holds ``train.epochs=6``. A section given whole is
set whole (``optim.lr=2 optim={name: adam}`` leaves ``lr`` at its default); a key after its section
changes that key only. :func:`replaced_overrides` names each override a later one replaces, one line
each. ``~key`` (Hydra's delete) removes the key from the file's settings, so it takes its default
again. Duplicate keys inside one YAML file stay refused: a file has no order a person means.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ddpkit.config.yaml_text import DuplicateKeyError, first_clause, parse_yaml, short_repr
from ddpkit.errors import ConfigError

__all__ = [
    "parse_override",
    "apply_override",
    "apply_overrides",
    "replaced_overrides",
    "log_replaced_overrides",
    "UNSET",
]

log = logging.getLogger(__name__)

#: The prefix that puts a key back to its default: ``~optim.momentum`` (Hydra's spelling).
UNSET = "~"


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``"a.b=value"`` into (``["a", "b"]``, parsed value). Raises ConfigError if malformed."""
    import yaml

    key, sep, value_text = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(
            f"bad override {short_repr(text)}: expected dotted.key=value, e.g. optim.lr=0.1 "
            f"(or {UNSET}dotted.key to put a key back to its default)"
        )
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
    # See read_yaml: a number too large for a float, an invalid timestamp.
    except (ValueError, OverflowError) as exc:
        raise ConfigError(
            f"bad override {short_repr(text)}: the value cannot be converted ({first_clause(exc)})"
        ) from None
    return key.split("."), value


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str], problems: list[str]) -> list[list[str]]:
    """Apply every override in order (the last one wins); return the keys ``~key`` named that were not set.

    The loader checks those against the schema: a key the file does not set is at its default already,
    but a misspelt one must still be told the key it meant.
    """
    not_set = []
    for text in overrides:
        if text.strip().startswith(UNSET):
            keys = _unset(raw, text, problems)
            if keys is not None:
                not_set.append(keys)
        else:
            apply_override(raw, text, problems)
    return not_set


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
            child = {}
            node[key] = child
        if not isinstance(child, dict):
            path = ".".join(keys[: depth + 1])
            problems.append(
                f"bad override {short_repr(text)}: {path} is {short_repr(child)}, not a section with sub-keys"
            )
            return
        node = child
    node[keys[-1]] = value


def _unset(raw: dict[str, Any], text: str, problems: list[str]) -> list[str] | None:
    """Remove ``~a.b``'s key from ``raw``; its keys when nothing was there to remove, else None."""
    key, sep, _ = text.strip()[len(UNSET) :].partition("=")
    keys = [part.strip() for part in key.split(".")]
    if not all(keys):
        problems.append(f"bad override {short_repr(text)}: expected {UNSET}dotted.key, e.g. {UNSET}optim.momentum")
        return None
    if sep:
        problems.append(
            f"bad override {short_repr(text)}: {UNSET}key takes no value; write {UNSET}{'.'.join(keys)} "
            "to put the key back to its default"
        )
        return None
    node = raw
    for key in keys[:-1]:
        node = node.get(key) if isinstance(node, dict) else None
    if not isinstance(node, dict) or keys[-1] not in node:
        return keys
    del node[keys[-1]]
    return None


def replaced_overrides(overrides: Sequence[str]) -> list[str]:
    """One line per override that a later one replaces, naming the key and both overrides.

    ``"train.epochs: override 3 ('train.epochs=40') replaces override 1 ('train.epochs=6'); on the
    command line the last one wins"``. A later key replaces an earlier one that is the same key or
    inside it (a section given whole), and a key inside an earlier section's value. Positions are
    1-based among the overrides; malformed ones are left to :func:`parse_override`.
    """
    keyed = [(position, text, _key_of(text)) for position, text in enumerate(overrides, start=1)]
    notes = []
    for index, (position, text, keys) in enumerate(keyed):
        for later_position, later_text, later_keys in keyed[index + 1 :]:
            where = _replaced_key(text, keys, later_keys)
            if where is not None:
                notes.append(
                    f"{where}: override {later_position} ({short_repr(later_text)}) replaces override {position} "
                    f"({short_repr(text)}); on the command line the last one wins"
                )
                break
    return notes


def log_replaced_overrides(overrides: Sequence[str]) -> None:
    """Log :func:`replaced_overrides`' lines as warnings: shown before ddpkit's logging is set up too."""
    for note in replaced_overrides(overrides):
        log.warning(note)


def _key_of(text: str) -> tuple[str, ...] | None:
    """The dotted key an override sets (``~`` removed), or None when it is malformed."""
    key, sep, _ = text.strip().removeprefix(UNSET).partition("=")
    keys = tuple(part.strip() for part in key.split("."))
    well_formed = all(keys) and (bool(sep) != text.strip().startswith(UNSET))
    return keys if well_formed else None


def _replaced_key(earlier: str, keys: tuple[str, ...] | None, later_keys: tuple[str, ...] | None) -> str | None:
    """The key of ``earlier`` that the later override replaces, or None if it replaces nothing there."""
    if keys is None or later_keys is None:
        return None
    if keys[: len(later_keys)] == later_keys:
        return ".".join(keys)
    if later_keys[: len(keys)] != keys or earlier.strip().startswith(UNSET):
        return None
    # The later key is inside the earlier one's section: it replaces something only if that value set it.
    try:
        _, node = parse_override(earlier)
    except ConfigError:
        return None
    for key in later_keys[len(keys) :]:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return ".".join(later_keys)
