"""Keys given twice in a YAML file are refused, naming both line numbers (PyYAML alone keeps the last and drops
the first silently), and so are keys given twice inside one override's value. Command-line overrides are ordered
and the last one wins (Hydra's rule): tests/test_override_habits.py.

    pytest -q tests/test_yaml_duplicates.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ddpkit.config import load_config
from ddpkit.config.yaml_text import DuplicateKeyError, parse_yaml
from ddpkit.errors import ConfigError

TWO_TRAIN_SECTIONS = """\
data: {name: digits}
train:
  epochs: 2
  log_every: 7
model: {name: mlp}
train:
  max_steps: 5
"""


def test_two_sections_in_a_file_name_both_lines(tmp_path: Path) -> None:
    path = tmp_path / "twice.yaml"
    path.write_text(TWO_TRAIN_SECTIONS)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert "`train` is given twice (lines 2 and 6)" in message
    assert str(path) in message and "merge them" in message


def test_nested_and_sequence_duplicates_carry_their_path() -> None:
    with pytest.raises(DuplicateKeyError) as err:
        parse_yaml("model:\n  kwargs:\n    layers:\n      - {a: 1, b: 2, a: 3}\n")
    assert err.value.duplicates == [("model.kwargs.layers[0].a", 4, 4)]
    with pytest.raises(DuplicateKeyError) as err:
        parse_yaml("optim:\n  lr: 0.1\n  lr: 0.2\n")
    assert err.value.duplicates == [("optim.lr", 2, 3)]


def test_merge_keys_and_distinct_keys_are_fine() -> None:
    # Overriding a key brought in by `<<: *anchor` is what a merge is for.
    assert parse_yaml("base: &b {lr: 1, wd: 0}\nfast:\n  <<: *b\n  lr: 2\n") == {
        "base": {"lr": 1, "wd": 0},
        "fast": {"lr": 2, "wd": 0},
    }
    # 1 (an int) and "1" (a string) are different keys.
    assert parse_yaml("m: {1: a, '1': b}") == {"m": {1: "a", "1": "b"}}


# Walked once per node it takes about 10 ms; expanded (9**9 leaves) it would run for minutes, so
# it fails here in seconds instead of at the suite's global 300 s.
@pytest.mark.timeout(10)
def test_an_alias_bomb_is_walked_once_per_node() -> None:
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8)
    )
    parse_yaml(bomb)  # would take minutes if aliases were expanded here


def test_an_override_value_with_a_key_twice_is_refused() -> None:
    with pytest.raises(ConfigError, match="gives `a` twice"):
        load_config(None, ["model.kwargs={a: 1, a: 2}"])
