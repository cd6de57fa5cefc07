"""How a config field is declared: :func:`option` records its documentation and its allowed range.

    lr: float = option(0.01, "Learning rate.", gt=0)

:mod:`ddpkit.config.loader` reads that metadata to check YAML input, and
``scripts/gen_config_reference.py`` to write ``docs/config.md``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any

__all__ = ["option", "yaml_key"]


def option(
    default: Any = dataclasses.MISSING,
    doc: str = "",
    *,
    factory: Any = dataclasses.MISSING,
    ge: float | None = None,
    gt: float | None = None,
    key: str | None = None,
) -> Any:
    """Declare a config field with its documentation and range.

    ``ge`` / ``gt`` bound numbers (``>=`` / ``>``); allowed strings are written as ``Literal``
    types. ``key`` is the YAML spelling when it differs from the Python name (``async`` is a
    Python keyword, so the field is ``async_save`` and the YAML key is ``async``).
    """
    metadata = {"doc": doc, "ge": ge, "gt": gt, "key": key}
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def yaml_key(f: dataclasses.Field) -> str:
    """The YAML key of a dataclass field (its name unless an alias was declared)."""
    return f.metadata.get("key") or f.name
