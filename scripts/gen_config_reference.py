"""Generate docs/config.md, the config reference, from the schema in ddpkit/config/schema.py.

    python scripts/gen_config_reference.py            # rewrite docs/config.md
    python scripts/gen_config_reference.py --check    # exit 1 if docs/config.md is out of date

Every section and field of :class:`ddpkit.config.schema.Config` gets a row: YAML key, type, default,
allowed values or range, and the documentation written next to the field with
``option(..., doc=...)``. The section texts are the dataclasses' docstrings. Edit the schema,
not the generated file; ``tests/test_docs.py`` fails when the two drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

# The walk of the dataclasses is shared with `ddpkit config --schema`: one reading of the schema.
from ddpkit.config.json_schema import dataclass_in, default_value, fields_of, optional, strip_none
from ddpkit.config.schema import Config

REPO = Path(__file__).resolve().parents[1]
OUTPUT = REPO / "docs" / "config.md"
COMMAND = "python scripts/gen_config_reference.py"

HEADER = f"""\
<!-- Generated from ddpkit/config/schema.py by `{COMMAND}`. Do not edit by hand:
     edit the field's `option(..., doc=...)` in ddpkit/config/schema.py and run the script again. -->

# Config reference

A run is described by a YAML file with the sections below; every key is optional and takes the
default shown. Values can be overridden on the command line as `section.key=value` (parsed as
YAML: `3` is an int, `true` a bool, `null` is None, `[1, 2]` a list, `3e-4` a number):

```bash
ddpkit run configs/quickstart.yaml --nproc-per-node 2 optim.lr=0.1 train.epochs=3
ddpkit config configs/quickstart.yaml optim.lr=0.1     # print the resolved config
```

Precedence: command-line overrides > YAML file > these defaults. Overrides apply in order and
the last one wins, as in Hydra (`... train.epochs=6 train.epochs=40` trains 40 epochs; a warning line
names the key and both overrides); a section given whole (`optim={{name: adam}}`) is set
whole. `~key` puts a key the file sets back to its default (`optim.name=adamw ~optim.momentum`
when the file has SGD with momentum; `key=null` is no default for a number). Duplicate keys
inside one YAML file are refused, naming both lines. Unknown keys are rejected
with the closest valid key suggested; wrong types and out-of-range values are reported with
the key, the value and what is expected, all problems in one message. The resolved config is
written to `<output_dir>/config.yaml` at start and stored in every checkpoint.

Numbers may be written in scientific notation, as in YAML 1.2 and every other tool: `lr: 3e-4`,
`weight_decay: 1E-2`, `optim.lr=5e+2` are floats (PyYAML's YAML 1.1 rules alone would read them
as text). An integer field accepts such a number when it is whole (`train.max_steps=1e5` is
100000) and reports "expected an integer" otherwise (`1e-3`). A string field keeps the text as
written (`run.name=1e3` is the name `1e3`), and a quoted `"3e-4"` is always a string.
"""


def render() -> str:
    """The whole of docs/config.md as text."""
    parts = [HEADER]
    sections = fields_of(Config)
    listing = "\n".join(f"- [`{key}`](#{key}): {f.metadata['doc']}" for key, f, _hint in sections)
    parts.append("## Sections\n\n" + listing + "\n")
    for key, _f, hint in sections:
        parts.extend(_section(key, hint))
    return "\n".join(parts)


def _section(path: str, cls: type, level: int = 2) -> list[str]:
    """A heading, the dataclass docstring and a table of its fields; nested sections follow."""
    rows = ["| key | type | default | allowed | description |", "|---|---|---|---|---|"]
    nested = []
    for name, f, tp in fields_of(cls):
        key = f"{path}.{name}"
        inner = dataclass_in(tp)
        if inner is not None:
            nested.append((key, inner))
            default = "`null`" if f.default is None else "see below"
            rows.append(
                _row(
                    key,
                    "section" + (" or null" if optional(tp) else ""),
                    default,
                    "",
                    f.metadata["doc"] + f" See [`{key}`](#{_anchor(key)}).",
                )
            )
            continue
        rows.append(_row(key, _type_name(tp), _default(f), _allowed(tp, f), f.metadata["doc"]))
        item = typing.get_args(strip_none(tp))[0] if typing.get_origin(strip_none(tp)) is list else None
        # a list of mappings with keys of their own (optim.groups): their table follows
        if dataclasses.is_dataclass(item):
            nested.append((key, item))
    doc = " ".join((cls.__doc__ or "").split())
    out = [f"{'#' * level} {path}\n", f"{doc}\n", "\n".join(rows) + "\n"]
    for key, inner in nested:
        out.extend(_section(key, inner, level + 1))
    return out


def _row(*cells: str) -> str:
    key, *rest = cells
    return "| " + " | ".join([f"`{key}`", *(c.replace("|", "\\|") for c in rest)]) + " |"


def _anchor(key: str) -> str:
    return key.replace(".", "").lower()  # GitHub drops the dots of a heading in its anchor


def _type_name(tp: Any) -> str:
    inner = strip_none(tp)
    origin = typing.get_origin(inner)
    if origin in (typing.Union, types.UnionType):  # e.g. bool | dict (train.compile)
        names = [
            " or ".join(f"`{v}`" for v in typing.get_args(a)) if typing.get_origin(a) is Literal else _type_name(a)
            for a in typing.get_args(inner)
        ]
        return " or ".join(names) + (" or null" if optional(tp) else "")
    if origin is Literal:
        name = "string"
    elif origin is list:
        name = f"list of {_type_name(typing.get_args(inner)[0])}"
    elif origin is dict or dataclasses.is_dataclass(inner):
        name = "mapping"
    else:
        name = {bool: "bool", int: "int", float: "float", str: "string"}[inner]
    return name + (" or null" if optional(tp) else "")


def _default(f: dataclasses.Field) -> str:
    return f"`{_yaml_scalar(default_value(f))}`"


def _yaml_scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"' if value == "" else value
    if isinstance(value, dict):
        return "{}" if not value else str(value)
    if isinstance(value, list):
        return "[" + ", ".join(_yaml_scalar(item) for item in value) + "]"
    return repr(value)


def _allowed(tp: Any, f: dataclasses.Field) -> str:
    inner = strip_none(tp)
    if typing.get_origin(inner) is list:  # the allowed items
        inner = typing.get_args(inner)[0]
    if typing.get_origin(inner) is Literal:
        return ", ".join(f"`{v}`" for v in typing.get_args(inner))
    bounds = []
    if f.metadata.get("ge") is not None:
        bounds.append(f">= {f.metadata['ge']:g}")
    if f.metadata.get("gt") is not None:
        bounds.append(f"> {f.metadata['gt']:g}")
    return ", ".join(bounds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare: exit 1 if the file is out of date")
    parser.add_argument(
        "--output", type=Path, default=OUTPUT, help=f"where to write (default {OUTPUT.relative_to(REPO)})"
    )
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.output.read_text(encoding="utf-8") if args.output.exists() else ""
        if current != text:
            print(f"{args.output} is out of date; regenerate it with: {COMMAND}", file=sys.stderr)
            return 1
        print(f"{args.output} is up to date")
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text, encoding="utf-8")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
