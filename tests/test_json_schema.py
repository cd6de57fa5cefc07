"""``ddpkit config --schema``: a JSON Schema that accepts every shipped config and refuses a misspelled key.

.venv/bin/pytest -q tests/test_json_schema.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import REPO, run_cli

from ddpkit.config.json_schema import DIALECT, config_schema, dataclass_in, fields_of, optional
from ddpkit.config.schema import Config
from ddpkit.config.yaml_text import read_yaml

jsonschema = pytest.importorskip("jsonschema")
SHIPPED = sorted((REPO / "configs").glob("*.yaml"))


@pytest.fixture(scope="module")
def validator():
    schema = config_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_is_valid(validator, path: Path):
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(read_yaml(path))]
    assert not errors, errors


def test_a_misspelled_key_a_bad_enum_and_a_range_are_refused(validator):
    def problems(config):
        return sorted(e.message for e in validator.iter_errors(config))

    assert problems({"optim": {"lr": 0.1, "momentun": 0.9}}) == [
        "Additional properties are not allowed ('momentun' was unexpected)"
    ]
    assert problems({"trian": {}}) == ["Additional properties are not allowed ('trian' was unexpected)"]
    assert "'fp8' is not one of ['fp32', 'bf16', 'fp16']" in problems({"train": {"precision": "fp8"}})
    assert problems({"data": {"batch_size": 0}}) == ["0 is less than the minimum of 1"]
    assert problems({"optim": {"lr": 0}}) == ["0 is less than or equal to the minimum of 0"]
    assert (
        problems(
            {
                "checkpoint": {"every_steps": "auto", "async": True, "best": None, "save_on_signals": ["SIGTERM"]},
                "dist": {"hang_timeout": None},
                "train": {"compile": {"mode": "max-autotune"}, "max_steps": 1e5},
            }
        )
        == []
    )


def test_every_field_has_its_type_default_and_the_docs_description():
    schema = config_schema()
    assert schema["$schema"] == DIALECT and schema["additionalProperties"] is False

    def walk(cls, node, path):
        for key, f, hint in fields_of(cls):
            prop = node["properties"][key]
            assert prop["description"] == f.metadata["doc"], f"{path}{key}"
            inner = dataclass_in(hint)
            if inner is None:
                assert "default" in prop, f"{path}{key}"
                continue
            section = prop["anyOf"][0] if optional(hint) else prop
            assert section["additionalProperties"] is False and section["type"] == "object"
            walk(inner, section, f"{path}{key}.")

    walk(Config, schema, "")
    lr = schema["properties"]["optim"]["properties"]["lr"]
    assert (lr["type"], lr["exclusiveMinimum"], lr["default"]) == ("number", 0, lr["default"])


@pytest.mark.multiprocess
def test_the_command_prints_it_and_writes_it_with_output(tmp_path):
    done = run_cli("config", "--schema")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == json.loads(json.dumps(config_schema()))
    done = run_cli("config", "--schema", "-o", str(tmp_path / "schema.json"))
    assert done.returncode == 0 and json.loads((tmp_path / "schema.json").read_text())["title"] == "ddpkit config"
