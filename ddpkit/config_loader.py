"""YAML + ``key=value`` overrides -> a typed, validated :class:`~ddpkit.config.Config`.

    cfg = load_config("configs/quickstart.yaml", ["optim.lr=0.1", "train.epochs=3"])

Rules, in the order they apply:

1. The file is read as UTF-8 and parsed with ``yaml.safe_load`` only: Python object tags are
   refused, nothing in a config is ever executed.
2. Overrides are ``dotted.key=value``; the value is parsed as a YAML scalar (``3`` is an int,
   ``true`` a bool, ``null`` None, ``[1, 2]`` a list). Precedence: overrides > file > defaults.
3. Keys are checked against the schema: an unknown key is reported with its full path and the
   closest valid key; a wrong type or out-of-range value with its path, the value and what is
   expected. All problems are collected and reported together in one :class:`ConfigError`.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import os
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from ddpkit.config import Config, cross_field_problems, yaml_key
from ddpkit.errors import ConfigError

__all__ = ["load_config", "parse_override", "config_to_dict", "dump_config", "config_hash", "flatten"]

# A config is a few kilobytes; these limits turn a pathological file into a clear error
# instead of minutes of parsing or an exponential "billion laughs" alias expansion.
MAX_FILE_BYTES = 1 << 20
MAX_DEPTH = 32
MAX_NODES = 100_000


def load_config(
    source: str | os.PathLike | Mapping[str, Any] | Config | None = None,
    overrides: Sequence[str] = (),
) -> Config:
    """Load and validate a config.

    Args:
        source: a YAML file path, a mapping with the same layout, an existing ``Config``
            (overrides are applied on top of it) or ``None`` for all defaults.
        overrides: ``dotted.key=value`` strings; values are parsed as YAML scalars.

    Raises:
        ConfigError: naming every problem found (file, keys, values) in one message.
    """
    origin = "<defaults>"
    stem = None
    if isinstance(source, Config):
        raw, origin = config_to_dict(source), "<Config>"
    elif isinstance(source, Mapping):
        raw, origin = _plain_copy(source), "<dict>"
    elif source is None:
        raw = {}
    else:
        path = Path(source)
        raw, origin, stem = read_yaml(path), str(path), path.stem

    problems: list[str] = []
    _check_size(raw, problems)
    for text in overrides:
        _apply_override(raw, text, problems)
    if not problems:
        cfg = _build(Config, raw, "", problems)
        if not problems:
            if not cfg.run.name:
                cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, name=stem or "run"))
            problems.extend(cross_field_problems(cfg))
    if problems:
        where = origin + (f" with overrides {list(overrides)}" if overrides else "")
        raise ConfigError(_format_problems(where, problems))
    return cfg


def read_yaml(path: Path) -> dict[str, Any]:
    """Read a YAML mapping from ``path`` with ``yaml.safe_load``, turning every failure into a ConfigError."""
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist; check the path (run from the project root?)")
    if path.is_dir():
        raise ConfigError(f"config path {path} is a directory; pass a YAML file such as {path}/quickstart.yaml")
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise ConfigError(f"config file {path} is {size} bytes; a config should be a small YAML file (limit {MAX_FILE_BYTES})")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {path} is not UTF-8 text (byte {exc.start} is 0x{data[exc.start]:02x}); "
            "save it as UTF-8 YAML"
        ) from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        detail = " ".join(str(exc).split())
        raise ConfigError(f"config file {path} is not valid YAML (only plain YAML is accepted, no Python tags): {detail}") from None
    except RecursionError:
        raise ConfigError(f"config file {path} is nested too deeply to be a config") from None
    if raw is None:
        raise ConfigError(f"config file {path} is empty; it needs at least one section, e.g. `data: {{name: digits}}`")
    if not isinstance(raw, dict):
        raise ConfigError(
            f"config file {path} must hold a mapping of sections (run, data, model, ...), "
            f"but its top level is a {type(raw).__name__}"
        )
    return raw


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``"a.b=value"`` into (``["a", "b"]``, parsed value). Raises ConfigError if malformed."""
    key, sep, value_text = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"bad override {text!r}: expected dotted.key=value, e.g. optim.lr=0.1")
    try:
        value = yaml.safe_load(value_text) if value_text.strip() else None
    except (yaml.YAMLError, RecursionError):
        raise ConfigError(f"bad override {text!r}: the value {value_text!r} is not a YAML value") from None
    return key.split("."), value


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
    """The resolved config as YAML text (loadable again by :func:`load_config`)."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False)


def config_hash(cfg: Config | Mapping[str, Any]) -> str:
    """A short, stable hash of a resolved config (same config -> same hash, on every rank)."""
    plain = cfg if isinstance(cfg, Mapping) else config_to_dict(cfg)
    text = json.dumps(plain, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


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


# --- internals ---------------------------------------------------------------------------


def _plain_copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain_copy(v) for v in value]
    return value


def _check_size(raw: Any, problems: list[str]) -> None:
    """Refuse absurdly deep or large structures (e.g. YAML alias bombs) before walking them."""
    budget = MAX_NODES
    stack = [(raw, 0)]
    while stack:
        value, depth = stack.pop()
        budget -= 1
        if depth > MAX_DEPTH:
            problems.append(f"<file>: nested more than {MAX_DEPTH} levels deep; a config is a few levels of sections")
            return
        if budget < 0:
            problems.append(f"<file>: more than {MAX_NODES} values; a config holds settings, not data")
            return
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)


def _apply_override(raw: dict[str, Any], text: str, problems: list[str]) -> None:
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
            problems.append(f"bad override {text!r}: {path} is {child!r}, not a section with sub-keys")
            return
        node = child
    node[keys[-1]] = value


def _build(cls: type, raw: Any, path: str, problems: list[str]) -> Any:
    """Turn a mapping into the dataclass ``cls``, appending a message per problem."""
    where = path.rstrip(".") or "<top level>"
    if not isinstance(raw, dict):
        problems.append(f"{where}: expected a mapping of keys for this section, got {_show(raw)}")
        return None
    fields = {yaml_key(f): f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    values = {}
    for key, value in raw.items():
        f = fields.get(key) if isinstance(key, str) else None
        if f is None:
            problems.append(_unknown_key_message(f"{path}{key}", list(fields), path))
            continue
        values[f.name] = _convert(hints[f.name], value, f"{path}{key}", f, problems)
    try:
        return cls(**values)
    except TypeError:  # only reachable when a problem was already recorded
        return None


def _convert(tp: Any, value: Any, path: str, f: dataclasses.Field | None, problems: list[str]) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, value, path, f, problems)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path + ".", problems)
    if origin is Literal:
        if isinstance(value, str) and value in args:
            return value
        hint = _closest(str(value), list(args))
        problems.append(f"{path}: expected one of {', '.join(args)}; got {_show(value)}" + (f" (did you mean {hint!r}?)" if hint else ""))
        return args[0]
    if origin is dict:
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return value
        problems.append(f"{path}: expected a mapping of name: value, got {_show(value)}")
        return {}
    return _convert_scalar(tp, value, path, f, problems)


def _convert_scalar(tp: type, value: Any, path: str, f: dataclasses.Field | None, problems: list[str]) -> Any:
    if tp is bool:
        ok = isinstance(value, bool)
        expected = "true or false"
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        expected = "an integer"
    elif tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        expected = "a finite number"
        value = float(value) if ok else value
    elif tp is str:
        ok = isinstance(value, str)
        expected = "a string (quote it if it looks like a number)"
    else:  # pragma: no cover - the schema only uses the types above
        raise AssertionError(f"unsupported config type {tp} at {path}")
    if not ok:
        problems.append(f"{path}: expected {expected}, got {_show(value)}")
        return value
    meta = f.metadata if f is not None else {}
    if meta.get("ge") is not None and value < meta["ge"]:
        problems.append(f"{path}: expected a value >= {meta['ge']:g}, got {value!r}")
    if meta.get("gt") is not None and value <= meta["gt"]:
        problems.append(f"{path}: expected a value > {meta['gt']:g}, got {value!r}")
    return value


def _unknown_key_message(path: str, valid: list[str], prefix: str) -> str:
    key = path[len(prefix):]
    hint = _closest(key, valid)
    if hint:
        suggestion = f"did you mean '{prefix}{hint}'?"
    else:
        elsewhere = _closest_anywhere(key)
        suggestion = f"did you mean {elsewhere!r}?" if elsewhere else f"valid keys here: {', '.join(valid)}"
    return f"{path}: unknown key; {suggestion}"


def _closest(word: str, candidates: list[str]) -> str | None:
    matches = difflib.get_close_matches(word, candidates, n=1, cutoff=0.5)
    return matches[0] if matches else None


def _closest_anywhere(word: str) -> str | None:
    """The full path of the schema key whose last part best matches ``word`` (``lr`` -> ``optim.lr``)."""
    leaves = {}
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(typing.get_type_hints(Config)[section.name]):
            leaves.setdefault(yaml_key(f), f"{section.name}.{yaml_key(f)}")
    leaves.update({yaml_key(f): yaml_key(f) for f in dataclasses.fields(Config)})
    hint = _closest(word, list(leaves))
    return leaves[hint] if hint else None


def _show(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"


def _format_problems(where: str, problems: list[str]) -> str:
    count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
    return f"invalid config {where}: {count}\n" + "\n".join(f"  - {p}" for p in problems)
