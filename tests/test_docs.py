"""The docs stay true: the config reference matches the schema, and links between docs resolve."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import typing
from pathlib import Path
from types import ModuleType

import pytest

from ddpkit.config.schema import Config, yaml_key

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
REGENERATE = "python scripts/gen_config_reference.py"


@pytest.fixture(scope="module")
def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_config_reference", REPO / "scripts" / "gen_config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def schema_fields(cls: type = Config, prefix: str = "") -> list[tuple[str, dataclasses.Field]]:
    """Every field of the schema as (dotted YAML key, field), nested sections included."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = prefix + yaml_key(f)
        out.append((key, f))
        inner = [a for a in typing.get_args(hints[f.name]) if dataclasses.is_dataclass(a)] or [hints[f.name]]
        if dataclasses.is_dataclass(inner[0]):
            out.extend(schema_fields(inner[0], key + "."))
    return out


def test_config_reference_matches_the_schema(generator):
    current = (DOCS / "config.md").read_text(encoding="utf-8")
    assert current == generator.render(), (
        f"docs/config.md is out of date with ddpkit/config/schema.py; regenerate it with: {REGENERATE}"
    )


def test_every_config_field_is_documented_and_listed(generator):
    text = generator.render()
    undocumented = [key for key, f in schema_fields() if not f.metadata.get("doc")]
    assert not undocumented, f"give these fields a doc= in ddpkit/config/schema.py: {undocumented}"
    sections = [key for key, _ in schema_fields() if "." not in key]
    leaves = [key for key, _ in schema_fields() if "." in key]
    assert all(f"## {key}\n" in text for key in sections)
    assert all(f"| `{key}` |" in text for key in leaves)
    assert "| `checkpoint.async` | bool | `false` |" in text  # the YAML spelling, not the Python name
    assert "| `dist.backend` | string | `auto` | `auto`, `nccl`, `gloo` |" in text
    assert "| `optim.lr` | float | `0.01` | > 0 |" in text


def test_check_mode_names_the_command_that_regenerates(generator, tmp_path, capsys):
    stale = tmp_path / "config.md"
    stale.write_text("old\n")
    assert generator.main(["--check", "--output", str(stale)]) == 1
    assert REGENERATE in capsys.readouterr().err
    assert generator.main(["--output", str(stale)]) == 0
    assert generator.main(["--check", "--output", str(stale)]) == 0


def test_relative_links_in_docs_resolve():
    broken = []
    for page in sorted(DOCS.glob("*.md")):
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.name}: {target}")
    assert not broken, f"broken links: {broken}"
