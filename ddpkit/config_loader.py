"""YAML + ``key=value`` overrides -> a typed, validated :class:`~ddpkit.config.Config`.

    cfg = load_config("configs/quickstart.yaml", ["optim.lr=0.1", "train.epochs=3"])

Rules, in the order they apply:

1. The file (a regular file of at most 1 MiB) is read as UTF-8 and parsed with ``yaml.safe_load``
   only: Python object tags are refused, nothing in a config is ever executed. Structures deeper
   than 32 levels or with more than 100,000 values (YAML alias bombs) are refused before use.
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

from ddpkit.config import Config, cross_field_problems, yaml_key
from ddpkit.errors import ConfigError

__all__ = ["load_config", "parse_override", "config_to_dict", "dump_config", "config_hash", "flatten"]

# A config is a few kilobytes; these limits turn a pathological file into a clear error
# instead of minutes of parsing or an exponential "billion laughs" alias expansion.
MAX_FILE_BYTES = 1 << 20
MAX_DEPTH = 32
MAX_NODES = 100_000
MAX_PROBLEMS_SHOWN = 30


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
        raw, origin = source, "<dict>"
    elif source is None:
        raw = {}
    else:
        path = Path(source)
        raw, origin, stem = read_yaml(path), str(path), path.stem

    problems: list[str] = []
    # Size first, before anything else walks the structure: a few YAML aliases can stand for
    # billions of values ("billion laughs"), and a dict given in code may even contain itself.
    _check_size(raw, problems)
    if not problems:
        raw = _plain_copy(raw)  # our own copy; aliased parts become independent, so an override changes one place
        for text in overrides:
            _apply_override(raw, text, problems)
        _check_size(raw, problems)  # override values are YAML too
    if not problems:
        cfg = _build(Config, raw, "", problems)
        if not problems:
            if not cfg.run.name:
                cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, name=stem or "run"))
            problems.extend(cross_field_problems(cfg))
    if problems:
        where = origin + (f" with overrides [{', '.join(_repr(o) for o in overrides)}]" if overrides else "")
        raise ConfigError(_format_problems(where, problems))
    return cfg


def read_yaml(path: Path) -> dict[str, Any]:
    """Read a YAML mapping from ``path`` with ``yaml.safe_load``, turning every failure into a ConfigError."""
    import yaml  # imported here, not at the top: keeps `import ddpkit` fast

    data = _read_config_bytes(path)
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
        if "python/" in detail:
            raise ConfigError(
                f"config file {path} uses a Python object tag (!!python/...), which would run code when loaded; "
                f"ddpkit reads plain YAML only, so remove the tag ({detail})"
            ) from None
        raise ConfigError(f"config file {path} is not valid YAML: {detail}") from None
    except RecursionError:
        raise ConfigError(f"config file {path} is nested too deeply to be a config") from None
    except (ValueError, OverflowError) as exc:
        # PyYAML's own converters: an integer beyond Python's digit limit, a date such as 2024-02-30.
        raise ConfigError(
            f"config file {path} holds a value YAML cannot convert ({_first_clause(exc)}); "
            "fix it, or quote it to keep it as a string"
        ) from None
    if raw is None:
        raise ConfigError(f"config file {path} is empty; it needs at least one section, e.g. `data: {{name: digits}}`")
    if not isinstance(raw, dict):
        raise ConfigError(
            f"config file {path} must hold a mapping of sections (run, data, model, ...), "
            f"but its top level is a {type(raw).__name__}"
        )
    return raw


def _read_config_bytes(path: Path) -> bytes:
    """The file's bytes, or a ConfigError saying why they cannot be had (never blocks on a pipe)."""
    try:
        if not path.exists():
            raise ConfigError(f"config file {path} does not exist; check the path (run from the project root?)")
        if path.is_dir():
            raise ConfigError(f"config path {path} is a directory; pass a YAML file such as {path}/quickstart.yaml")
        if not path.is_file():
            # A FIFO would block until someone writes to it; a device may never end.
            raise ConfigError(f"config path {path} is not a regular file (a pipe, socket or device?); pass a YAML file")
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror or exc}; check the path and its permissions") from None
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"config file {path} is larger than {MAX_FILE_BYTES} bytes; a config should be a small YAML file")
    return data


def _first_clause(exc: BaseException) -> str:
    """``"Exceeds the limit (4300 digits) ...; use sys.set_int_max_str_digits() ..."`` -> the part before ``;``."""
    return str(exc).split(";")[0].strip() or type(exc).__name__


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``"a.b=value"`` into (``["a", "b"]``, parsed value). Raises ConfigError if malformed."""
    import yaml

    key, sep, value_text = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"bad override {_repr(text)}: expected dotted.key=value, e.g. optim.lr=0.1")
    try:
        value = yaml.safe_load(value_text) if value_text.strip() else None
    except (yaml.YAMLError, RecursionError):
        raise ConfigError(f"bad override {_repr(text)}: the value is not a YAML value; quote it if it is a string") from None
    except (ValueError, OverflowError) as exc:  # see read_yaml
        raise ConfigError(f"bad override {_repr(text)}: the value cannot be converted ({_first_clause(exc)})") from None
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
    import yaml

    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False)


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


# --- internals ---------------------------------------------------------------------------


def _plain_copy(value: Any) -> Any:
    """A deep copy of nested mappings and sequences (as dicts and lists); call after ``_check_size``."""
    if isinstance(value, Mapping):
        return {k: _plain_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain_copy(v) for v in value]
    return value


def _check_size(raw: Any, problems: list[str]) -> None:
    """Refuse absurdly deep or large structures (e.g. YAML alias bombs) before walking them.

    Counts a value each time it is reached, so an alias counts as often as it is used: exactly
    what copying or printing the structure would cost.
    """
    budget = MAX_NODES
    stack = [(raw, 0, "")]
    while stack:
        value, depth, path = stack.pop()
        budget -= 1
        if depth > MAX_DEPTH:
            problems.append(f"{_under(path)}: nested more than {MAX_DEPTH} levels deep; a config is a few levels of sections")
            return
        if budget < 0:
            problems.append(
                f"{_under(path)}: the config holds more than {MAX_NODES} values (aliases count each time "
                "they are used); a config holds settings, not data"
            )
            return
        if isinstance(value, Mapping):
            stack.extend((v, depth + 1, f"{path}.{_key(k)}" if path else _key(k)) for k, v in value.items())
        elif isinstance(value, (list, tuple)):
            stack.extend((v, depth + 1, f"{path}[{i}]") for i, v in enumerate(value))


def _key(key: Any) -> str:
    return key if isinstance(key, str) else _repr(key)


def _under(path: str) -> str:
    """Where a deep path starts, for messages: ``"model.kwargs.x[6][8][7]"`` -> ``"model.kwargs.x..."``."""
    parts = path.split("[", 1)[0].split(".")
    head = ".".join(parts[:3]) or "<top level>"
    return head + ("..." if len(parts) > 3 or "[" in path else "")


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
            problems.append(f"bad override {_repr(text)}: {path} is {_repr(child)}, not a section with sub-keys")
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
            problems.append(_unknown_key_message(f"{path}{_key(key)}", list(fields), path))
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
        hint = _closest(value if isinstance(value, str) else _repr(value), list(args))
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
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and _finite(value)
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
        problems.append(f"{path}: expected a value >= {meta['ge']:g}, got {_repr(value)}")
    if meta.get("gt") is not None and value <= meta["gt"]:
        problems.append(f"{path}: expected a value > {meta['gt']:g}, got {_repr(value)}")
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


def _finite(number: int | float) -> bool:
    try:
        return math.isfinite(number)
    except OverflowError:  # an int too large for a float
        return False


def _repr(value: Any) -> str:
    """``repr(value)``, at most 60 characters (and an int too long for ``repr`` is described instead)."""
    try:
        text = repr(value)
    except ValueError:  # int beyond sys.get_int_max_str_digits()
        text = f"<an integer of {value.bit_length()} bits>"
    return text if len(text) <= 60 else text[:57] + "..."


def _show(value: Any) -> str:
    return f"{_repr(value)} ({type(value).__name__})"


def _format_problems(where: str, problems: list[str]) -> str:
    count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
    shown = [f"  - {p}" for p in problems[:MAX_PROBLEMS_SHOWN]]
    if len(problems) > MAX_PROBLEMS_SHOWN:  # a wrong file (data, not a config) would print thousands of lines
        shown.append(f"  ... and {len(problems) - MAX_PROBLEMS_SHOWN} more")
    return f"invalid config {where}: {count}\n" + "\n".join(shown)
