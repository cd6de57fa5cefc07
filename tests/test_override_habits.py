"""Three habits users bring from Hydra and plain PyTorch (issue 55): command-line overrides are ordered and the
last one wins, ``~key`` puts a key back to its default, and a module a Trainer subclass builds in its own
``__init__`` gets the same weights in every launch (the Trainer seeds from ``run.seed`` when constructed).

    pytest -q tests/test_override_habits.py
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from helpers import REPO, tiny_config

from ddpkit import Trainer
from ddpkit.cli import main as cli_main
from ddpkit.config import load_config
from ddpkit.config.overrides import replaced_overrides
from ddpkit.config.schema import OptimConfig
from ddpkit.errors import ConfigError
from ddpkit.launch.entrypoint import parse_worker_argv

MOMENTUM_YAML = "optim: {name: sgd, lr: 0.1, momentum: 0.9}\ndata: {batch_size: 16}\n"


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name.startswith("ddpkit")]


def test_a_key_given_twice_on_the_command_line_takes_the_last_and_one_line_names_both(caplog) -> None:
    # A wrapper script's fixed list, then one more setting appended (issue 55's `$COMMON train.epochs=40`).
    overrides = ["train.epochs=6", "optim.lr=0.1", "train.epochs=40"]
    with caplog.at_level(logging.WARNING, logger="ddpkit"):
        cfg = load_config(None, overrides, log_replaced=True)
    assert cfg.train.epochs == 40 and cfg.optim.lr == 0.1
    assert _messages(caplog) == [
        "train.epochs: override 3 ('train.epochs=40') replaces override 1 ('train.epochs=6'); "
        "on the command line the last one wins"
    ]
    # Three times: each replaced one is named once, by the override that replaced it.
    assert load_config(None, ["train.epochs=6", "train.epochs=8", "train.epochs=40"]).train.epochs == 40
    assert [note.split(";")[0] for note in replaced_overrides(["a.b=6", "a.b=8", "a.b=40"])] == [
        "a.b: override 2 ('a.b=8') replaces override 1 ('a.b=6')",
        "a.b: override 3 ('a.b=40') replaces override 2 ('a.b=8')",
    ]


def test_sections_and_keys_inside_them_apply_in_order() -> None:
    # A key after its section: the key wins inside it, the section's other keys stay.
    cfg = load_config(None, ["optim={name: adam, lr: 1}", "optim.lr=2"])
    assert (cfg.optim.name, cfg.optim.lr) == ("adam", 2.0)
    assert replaced_overrides(["optim={name: adam, lr: 1}", "optim.lr=2"]) == [
        "optim.lr: override 2 ('optim.lr=2') replaces override 1 ('optim={name: adam, lr: 1}'); "
        "on the command line the last one wins"
    ]
    # A section after a key inside it: the section is set whole, the earlier key is gone.
    cfg = load_config(None, ["optim.lr=2", "optim={name: adam}"])
    assert (cfg.optim.name, cfg.optim.lr) == ("adam", OptimConfig().lr)
    assert [note.split(";")[0] for note in replaced_overrides(["optim.lr=2", "optim={name: adam}"])] == [
        "optim.lr: override 2 ('optim={name: adam}') replaces override 1 ('optim.lr=2')"
    ]
    # A key the earlier section did not set adds to it: nothing is replaced, nothing is said.
    assert replaced_overrides(["optim={name: adam}", "optim.lr=2", "optim.momentum=0.5", "optim.kwargs.a=1"]) == []


def test_duplicate_keys_inside_one_yaml_file_are_still_refused(tmp_path: Path) -> None:
    path = tmp_path / "twice.yaml"
    path.write_text("train:\n  epochs: 2\n  epochs: 3\n")
    with pytest.raises(ConfigError, match=r"`train.epochs` is given twice \(lines 2 and 3\)"):
        load_config(path, ["train.epochs=4"])


def test_only_rank_0_of_a_multi_rank_run_says_it(tiny_cfg, monkeypatch, caplog) -> None:
    overrides = ["train.epochs=1", "train.epochs=2"]
    for rank, expected in ((0, 1), (1, 0)):
        launcher = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": 2, "LOCAL_WORLD_SIZE": 2, "MASTER_PORT": 1}
        for name, value in {**launcher, "MASTER_ADDR": "127.0.0.1"}.items():
            monkeypatch.setenv(name, str(value))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ddpkit"):
            assert Trainer(tiny_cfg, overrides=overrides).config.train.epochs == 2
        assert len([m for m in _messages(caplog) if m.startswith("train.epochs: override 2")]) == expected, rank


def test_tilde_puts_a_key_from_the_file_back_to_its_default(tmp_path: Path) -> None:
    path = tmp_path / "sgd.yaml"
    path.write_text(MOMENTUM_YAML)
    with pytest.raises(ConfigError) as err:
        load_config(path, ["optim.name=adamw"])
    assert "adamw has no momentum argument" in str(err.value) and "~optim.momentum" in str(err.value)
    cfg = load_config(path, ["optim.name=adamw", "~optim.momentum"])
    assert (cfg.optim.name, cfg.optim.momentum, cfg.optim.lr) == ("adamw", OptimConfig().momentum, 0.1)
    # `null` is no way back to the default for a number; the error says which way is.
    with pytest.raises(ConfigError, match=r"optim.momentum: expected a finite number, got None .*~optim.momentum"):
        load_config(path, ["optim.momentum=null"])
    # A whole section, and a file key that excludes another (data.batch_size against global_batch_size).
    assert load_config(path, ["~optim"]).optim == OptimConfig()
    with pytest.raises(ConfigError, match="~data.batch_size"):
        load_config(path, ["data.global_batch_size=64"])
    assert load_config(path, ["~data.batch_size", "data.global_batch_size=64"]).data.global_batch_size == 64


def test_tilde_is_ordered_with_the_other_overrides_and_checked_against_the_schema(tmp_path: Path) -> None:
    path = tmp_path / "sgd.yaml"
    path.write_text(MOMENTUM_YAML)
    assert load_config(path, ["~optim.momentum", "optim.momentum=0.5"]).optim.momentum == 0.5
    assert load_config(path, ["optim.momentum=0.5", "~optim.momentum"]).optim.momentum == 0.0
    assert replaced_overrides(["optim.momentum=0.5", "~optim.momentum"])[0].startswith(
        "optim.momentum: override 2 ('~optim.momentum') replaces override 1 ('optim.momentum=0.5')"
    )
    # A key the file does not set is at its default already; free-form mappings take any key.
    assert load_config(None, ["~train.max_steps", "~optim.kwargs.betas"]) == load_config(None)
    assert load_config(None, ["optim.kwargs={betas: [0.9, 0.95]}", "~optim.kwargs.betas"]).optim.kwargs == {}
    with pytest.raises(ConfigError, match=r"~optim.momentun: unknown key; did you mean '~optim.momentum'\?"):
        load_config(path, ["~optim.momentun"])
    with pytest.raises(ConfigError, match=r"~optim.lr.x: optim.lr is a value, not a section"):
        load_config(None, ["~optim.lr.x"])
    with pytest.raises(ConfigError, match=r"'~optim.momentum=0': ~key takes no value; write ~optim.momentum"):
        load_config(path, ["~optim.momentum=0"])
    with pytest.raises(ConfigError, match=r"bad override '~': expected ~dotted.key"):
        load_config(path, ["~"])


def test_a_tilde_first_on_a_scripts_command_line_is_an_override_not_the_config_path() -> None:
    # `python train.py ~optim.momentum`: no config file, one override.
    assert parse_worker_argv(["~optim.momentum"]) == (None, ["~optim.momentum"])
    assert parse_worker_argv(["~optim", "train.epochs=2"]) == (None, ["~optim", "train.epochs=2"])
    assert parse_worker_argv(["exp.yaml", "~optim.momentum"]) == ("exp.yaml", ["~optim.momentum"])


def test_ddpkit_config_says_which_override_a_later_one_replaced(tmp_path: Path, capsys, caplog) -> None:
    path = tmp_path / "sgd.yaml"
    path.write_text(MOMENTUM_YAML)
    with caplog.at_level(logging.WARNING, logger="ddpkit"), pytest.raises(SystemExit) as done:
        cli_main(["config", str(path), "train.epochs=6", "train.epochs=40"])
    assert done.value.code == 0
    assert yaml.safe_load(capsys.readouterr().out)["train"]["epochs"] == 40
    assert _messages(caplog) == [
        "train.epochs: override 2 ('train.epochs=40') replaces override 1 ('train.epochs=6'); "
        "on the command line the last one wins"
    ]


# What a user's script does: a module built in the subclass's __init__, after super().__init__().
AUX_SCRIPT = """\
import hashlib, sys
import torch
import ddpkit

class AuxTrainer(ddpkit.Trainer):
    def __init__(self, config, *, overrides=()):
        super().__init__(config, overrides=overrides)
        self.head = torch.nn.Linear(32, 8)

torch.seed()  # torch 2.14 starts every process from a random seed; so does this line on older releases
head = AuxTrainer(sys.argv[1], overrides=sys.argv[2:]).head
print(hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in head.parameters())).hexdigest())
"""


def _launch(script: Path, config: Path, *overrides: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(script), str(config), *overrides],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.multiprocess
def test_a_module_built_in_a_subclass_init_is_the_same_in_every_launch(tmp_path: Path) -> None:
    script = tmp_path / "aux_trainer.py"
    script.write_text(AUX_SCRIPT)
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_config(tmp_path)))
    first = _launch(script, config)
    assert _launch(script, config) == first
    # The seed is run.seed's: another seed gives other weights.
    assert _launch(script, config, "run.seed=1") != first


def test_the_trainer_seeds_from_run_seed_when_constructed(tiny_cfg) -> None:
    heads = []
    for seed in (0, 0, 1):
        torch.seed()
        Trainer(tiny_cfg, overrides=[f"run.seed={seed}"])
        heads.append(torch.nn.Linear(32, 8).weight)
    assert torch.equal(heads[0], heads[1]) and not torch.equal(heads[0], heads[2])
