"""YAML + ``key=value`` overrides -> a typed, validated :class:`~ddpkit.config.schema.Config`.

    cfg = load_config("configs/quickstart.yaml", ["optim.lr=0.1", "train.epochs=3"])

Rules, in the order they apply:

1. The file is read safely (:mod:`ddpkit.config.yaml_text`: a regular UTF-8 file of at most 1 MiB,
   ``yaml.safe_load`` only, no alias bombs).
2. Overrides (:mod:`ddpkit.config.overrides`) are ``dotted.key=value``; the value is parsed as a
   YAML scalar. Precedence: overrides > file > defaults. They apply in order and the last one wins
   (one warning line names each one replaced); ``~dotted.key`` puts a key back to its default.
3. Keys are checked against the schema (here): an unknown key is reported with its full path and
   the closest valid key; a wrong type or out-of-range value with its path, the value and what is
   expected. All problems are collected and reported together in one :class:`ConfigError`.

Turning a config back into plain data (dicts, YAML, a hash, flat keys) is :mod:`ddpkit.config.serialize`.
"""

from __future__ import annotations

import dataclasses
import decimal
import difflib
import math
import os
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from ddpkit.config.checks import cross_field_problems
from ddpkit.config.overrides import UNSET, apply_overrides, log_replaced_overrides
from ddpkit.config.schema import Config, yaml_key
from ddpkit.config.serialize import as_written
from ddpkit.config.yaml_text import NumberText, check_size, key_text, plain_copy, read_yaml, short_repr, show
from ddpkit.errors import ConfigError

__all__ = ["load_config"]

MAX_PROBLEMS_SHOWN = 30


def load_config(
    source: str | os.PathLike | Mapping[str, Any] | Config | None = None,
    overrides: Sequence[str] = (),
    *,
    log_replaced: bool = False,
) -> Config:
    """Load and validate a config.

    Args:
        source: a YAML file path, a mapping with the same layout, an existing ``Config``
            (overrides are applied on top of it) or ``None`` for all defaults.
        overrides: ``dotted.key=value`` strings, values parsed as YAML scalars, and ``~dotted.key``
            (the key back to its default); applied in order, the last one wins.
        log_replaced: log one warning line per override a later one replaces. The Trainer's rank 0
            does, so a launch says it once (the launcher's own check and the other ranks stay quiet).

    Raises:
        ConfigError: naming every problem found (file, keys, values) in one message.
    """
    raw, origin, stem = _read_source(source)
    problems: list[str] = []
    # Size first, before anything else walks the structure: a few YAML aliases can stand for
    # billions of values ("billion laughs"), and a dict given in code may even contain itself.
    check_size(raw, problems)
    if not problems:
        # Our own copy: aliased parts become independent, so an override changes one place.
        raw = plain_copy(raw)
        not_set = apply_overrides(raw, overrides, problems)
        problems.extend(_unset_key_problems(not_set))
        # Override values are YAML too.
        check_size(raw, problems)
    if not problems:
        cfg = _build(Config, raw, "", problems)
        if not problems:
            if not cfg.run.name:
                cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, name=stem or "run"))
            problems.extend(cross_field_problems(cfg) + _given_together(cfg, raw))
    if problems:
        where = origin + (f" with overrides [{', '.join(short_repr(o) for o in overrides)}]" if overrides else "")
        raise ConfigError(_format_problems(where, problems))
    if log_replaced:
        log_replaced_overrides(overrides)
    return cfg


def _read_source(source: Any) -> tuple[Any, str, str | None]:
    """(raw mapping, where it came from, the file's stem for the default run name)."""
    if isinstance(source, Config):
        return as_written(source), "<Config>", None
    if isinstance(source, Mapping):
        return source, "<dict>", None
    if source is None:
        return {}, "<defaults>", None
    path = Path(source)
    return read_yaml(path), str(path), path.stem


def _given_together(cfg: Config, raw: dict[str, Any]) -> list[str]:
    """Fields that exclude each other when both are written (a default is not "written")."""
    data = raw.get("data") or {}
    if cfg.data.global_batch_size is not None and "batch_size" in data:
        return [
            "data.global_batch_size: set together with data.batch_size; give one of them "
            "(global_batch_size derives the per-rank batch from the world size); to drop the file's "
            f"data.batch_size, add {UNSET}data.batch_size on the command line"
        ]
    return []


def _unset_key_problems(not_set: list[list[str]]) -> list[str]:
    """``~key`` overrides whose key nothing set: fine for a key of the schema (it is at its default), a
    problem naming the closest valid key otherwise. Below a free-form mapping (``optim.kwargs``) any key is fine."""
    problems = []
    for keys in not_set:
        cls: Any = Config
        for depth, key in enumerate(keys):
            prefix = "".join(f"{k}." for k in keys[:depth])
            fields = {yaml_key(f): f for f in dataclasses.fields(cls)}
            if key not in fields:
                problems.append(_unknown_key_message(f"{UNSET}{prefix}{key}", list(fields), f"{UNSET}{prefix}"))
                break
            cls = _section_type(typing.get_type_hints(cls)[fields[key].name])
            if cls is None:
                if depth + 1 < len(keys):
                    problems.append(
                        f"{UNSET}{'.'.join(keys)}: {prefix}{key} is a value, not a section; write {UNSET}{prefix}{key}"
                    )
                break
            if cls is dict:
                break
    return problems


def _section_type(tp: Any) -> Any:
    """A field's section dataclass, ``dict`` for a free-form mapping, or None for a value (nullable or not)."""
    union = typing.get_origin(tp) in (typing.Union, types.UnionType)
    for arg in [a for a in typing.get_args(tp) if a is not type(None)] if union else [tp]:
        if dataclasses.is_dataclass(arg):
            return arg
        if (typing.get_origin(arg) or arg) is dict:
            return dict
    return None


def _build(cls: type, raw: Any, path: str, problems: list[str]) -> Any:
    """Turn a mapping into the dataclass ``cls``, appending a message per problem."""
    where = path.rstrip(".") or "<top level>"
    if not isinstance(raw, dict):
        problems.append(f"{where}: expected a mapping of keys for this section, got {show(raw)}")
        return None
    fields = {yaml_key(f): f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    values = {}
    for key, value in raw.items():
        f = fields.get(key) if isinstance(key, str) else None
        if f is None:
            problems.append(_unknown_key_message(f"{path}{key_text(key)}", list(fields), path))
            continue
        values[f.name] = _convert(hints[f.name], value, f"{path}{key}", f, problems)
    try:
        return cls(**values)
    except TypeError:
        # Only reachable when a problem was already recorded.
        return None


def _convert(tp: Any, value: Any, path: str, f: dataclasses.Field | None, problems: list[str]) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        # More than one type, e.g. `bool | dict[str, Any]` (train.compile): the first type the value has.
        if len(inner) > 1:
            inner = [next((a for a in inner if _fits(a, value)), inner[0])]
        return _convert(inner[0], value, path, f, problems)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path + ".", problems)
    if origin is Literal:
        if isinstance(value, str) and value in args:
            return value
        hint = _closest(value if isinstance(value, str) else short_repr(value), list(args))
        problems.append(
            f"{path}: expected one of {', '.join(args)}; got {show(value)}"
            + (f" (did you mean {hint!r}?)" if hint else "")
        )
        return args[0]
    if origin is list:
        if isinstance(value, list):
            return [_convert(args[0], item, f"{path}[{i}]", None, problems) for i, item in enumerate(value)]
        problems.append(f"{path}: expected a list, e.g. [a, b] (or [] for none), got {show(value)}")
        return []
    if origin is dict:
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return _numbers_as_written(value)
        problems.append(f"{path}: expected a mapping of name: value, got {show(value)}")
        return {}
    return _convert_scalar(tp, value, path, f, problems)


def _fits(tp: Any, value: Any) -> bool:
    """Whether ``value`` is meant as ``tp``, one member of a union: a number for a float, any word for a Literal
    (so a misspelt ``dist.hang_timeout=atuo`` is told the words it may be)."""
    if typing.get_origin(tp) is Literal:
        return isinstance(value, str) and not isinstance(value, NumberText)
    if tp is float:
        return isinstance(value, (int, float, NumberText)) and not isinstance(value, bool)
    return isinstance(value, typing.get_origin(tp) or tp)


def _numbers_as_written(value: Any) -> Any:
    """Free-form values (``model.kwargs``, ``optim.kwargs``): an unquoted ``1e-8`` is the float it reads as."""
    if isinstance(value, NumberText):
        return float(value)
    if isinstance(value, dict):
        return {k: _numbers_as_written(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_numbers_as_written(v) for v in value]
    return value


def _from_number_text(tp: type, value: NumberText) -> Any:
    """``3e-4`` written unquoted, as the field's type reads it (see :mod:`ddpkit.config.yaml_text`).

    A float field gets the float; an int field gets the int when the number is whole (``1e5`` is
    100000) and keeps the text otherwise, so the usual "expected an integer" message names it;
    a string field keeps the text as written (``run.name=1e3`` is the name "1e3").
    """
    if tp is float:
        return float(value)
    if tp is int:
        exact = decimal.Decimal(value.replace("_", ""))
        return int(exact) if exact == exact.to_integral_value() else str(value)
    return str(value)


def _convert_scalar(tp: type, value: Any, path: str, f: dataclasses.Field | None, problems: list[str]) -> Any:
    if isinstance(value, NumberText):
        value = _from_number_text(tp, value)
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
        # `key=null` is how a user tries to undo a file's setting; say what does.
        undo = f"; to put it back to its default, write {UNSET}{path}" if value is None and f is not None else ""
        problems.append(f"{path}: expected {expected}, got {show(value)}{undo}")
        return value
    meta = f.metadata if f is not None else {}
    if meta.get("ge") is not None and value < meta["ge"]:
        problems.append(f"{path}: expected a value >= {meta['ge']:g}, got {short_repr(value)}")
    if meta.get("gt") is not None and value <= meta["gt"]:
        problems.append(f"{path}: expected a value > {meta['gt']:g}, got {short_repr(value)}")
    return value


def _unknown_key_message(path: str, valid: list[str], prefix: str) -> str:
    key = path[len(prefix) :]
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
    except OverflowError:
        # An int too large for a float has no finite float value.
        return False


def _format_problems(where: str, problems: list[str]) -> str:
    count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
    shown = [f"  - {p}" for p in problems[:MAX_PROBLEMS_SHOWN]]
    # A wrong file (data, not a config) would print thousands of lines.
    if len(problems) > MAX_PROBLEMS_SHOWN:
        shown.append(f"  ... and {len(problems) - MAX_PROBLEMS_SHOWN} more")
    return f"invalid config {where}: {count}\n" + "\n".join(shown)
