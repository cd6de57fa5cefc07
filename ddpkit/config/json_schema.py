"""A JSON Schema of the whole config, for editors: ``ddpkit config --schema``.

    schema = config_schema()                          # a dict: json.dumps(schema) is the file
    for key, f, hint in fields_of(TrainConfig): ...   # the one walk of the dataclasses (docs/config.md uses it too)

Every section and field of :class:`ddpkit.config.schema.Config` becomes a JSON Schema (draft 2020-12)
property: its type, the allowed strings of a ``Literal`` as an ``enum``, the ``ge`` / ``gt`` bounds as
``minimum`` / ``exclusiveMinimum``, the default, and the field's documentation as its
``description``, the same text ``scripts/gen_config_reference.py`` writes to ``docs/config.md``.
Every object has ``additionalProperties: false``, so an editor marks a misspelled key as
the loader would refuse it. With yaml-language-server (VS Code's YAML extension, Neovim), the first
line of a config file selects it::

    # yaml-language-server: $schema=ddpkit-config.schema.json

What a schema cannot say, the loader still checks: cross-field rules (:mod:`ddpkit.config.checks`).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal

from ddpkit.config.fields import yaml_key
from ddpkit.config.schema import Config

__all__ = ["config_schema", "fields_of", "optional", "strip_none", "dataclass_in", "default_value", "DIALECT"]

DIALECT = "https://json-schema.org/draft/2020-12/schema"
_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string"}


def fields_of(cls: type) -> list[tuple[str, dataclasses.Field, Any]]:
    """A config dataclass's fields in order: (YAML key, the field, its resolved type hint)."""
    hints = typing.get_type_hints(cls)
    return [(yaml_key(f), f, hints[f.name]) for f in dataclasses.fields(cls)]


def optional(tp: Any) -> bool:
    """Whether the hint admits None (``int | None``)."""
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)


def strip_none(tp: Any) -> Any:
    """The hint without its None (``int | None`` -> ``int``)."""
    if optional(tp):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return inner[0] if len(inner) == 1 else typing.Union[tuple(inner)]  # noqa: UP007 - built from a tuple
    return tp


def dataclass_in(tp: Any) -> type | None:
    """The section class of a nested section's hint (``BestConfig | None`` -> BestConfig), else None."""
    inner = strip_none(tp)
    return inner if dataclasses.is_dataclass(inner) else None


def default_value(f: dataclasses.Field) -> Any:
    """The field's default (a factory's product for mutable ones)."""
    return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]


def config_schema() -> dict[str, Any]:
    """The JSON Schema of a ddpkit YAML config file."""
    return {"$schema": DIALECT, "title": "ddpkit config", **_section(Config)}


def _section(cls: type) -> dict[str, Any]:
    properties = {}
    for key, f, hint in fields_of(cls):
        inner = dataclass_in(hint)
        schema = _section(inner) if inner is not None else _value(strip_none(hint), f)
        if optional(hint):
            schema = {"anyOf": [schema, {"type": "null"}]}
        # a section's: the field's text, as in docs/config.md's row
        properties[key] = {**schema, "description": f.metadata.get("doc", "")}
        if inner is None or f.default is None:
            properties[key]["default"] = _plain(default_value(f))
    return {
        "type": "object",
        "description": " ".join((cls.__doc__ or "").split()),
        "properties": properties,
        "additionalProperties": False,
    }


def _value(tp: Any, f: dataclasses.Field) -> dict[str, Any]:
    """The schema of a non-section type (None already taken out)."""
    origin = typing.get_origin(tp)
    # A union (int | Literal["auto"], bool | dict): the value may be any of its members.
    if origin in (typing.Union, types.UnionType):
        return {"anyOf": [_value(member, f) for member in typing.get_args(tp)]}
    if origin is Literal:
        return {"enum": list(typing.get_args(tp))}
    if origin is list:
        return {"type": "array", "items": _value(typing.get_args(tp)[0], f)}
    if origin is dict or tp is dict:
        return {"type": "object"}
    # The items of a list of mappings (optim.groups) are sections of their own.
    if dataclasses.is_dataclass(tp):
        return _section(tp)
    schema: dict[str, Any] = {"type": _JSON_TYPES[tp]}
    if tp in (int, float):
        if f.metadata.get("ge") is not None:
            schema["minimum"] = f.metadata["ge"]
        if f.metadata.get("gt") is not None:
            schema["exclusiveMinimum"] = f.metadata["gt"]
    return schema


def _plain(value: Any) -> Any:
    """A default as JSON (a nested section's default: its fields by YAML key)."""
    if dataclasses.is_dataclass(value):
        return {key: _plain(getattr(value, f.name)) for key, f, _hint in fields_of(type(value))}
    return value
