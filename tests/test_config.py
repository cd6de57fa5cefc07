"""The config schema and loader: strict keys and types, overrides, precedence, messages."""

from __future__ import annotations

import pytest
import yaml
from helpers import run_cli

from ddpkit import ConfigError, load_config
from ddpkit.config.overrides import parse_override
from ddpkit.config.serialize import config_hash, dump_config


def write(tmp_path, text: str, name: str = "exp.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_name_and_output_dir_come_from_the_file(tmp_path):
    cfg = load_config(write(tmp_path, "data: {name: digits}\n", "my_exp.yaml"))
    assert cfg.run.name == "my_exp"
    assert cfg.output_dir == "runs/my_exp"
    assert cfg.checkpoint_dir == "runs/my_exp/checkpoints"
    assert cfg.data.batch_size == 32 and cfg.optim.name == "sgd"


def test_unknown_key_names_full_path_and_closest_key(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, "optim: {lrr: 0.1}\n"))
    assert "optim.lrr: unknown key; did you mean 'optim.lr'?" in str(err.value)


def test_unknown_top_level_key_suggests_the_section_it_belongs_to(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, "lr: 0.1\n"))
    assert "lr: unknown key; did you mean 'optim.lr'?" in str(err.value)


def test_wrong_type_names_path_value_and_expectation(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, "train: {epochs: three}\n"))
    assert "train.epochs: expected an integer, got 'three' (str)" in str(err.value)


def test_out_of_range_and_bad_choice(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, "data: {batch_size: 0}\ntrain: {precision: fp8}\n"))
    message = str(err.value)
    assert "data.batch_size: expected a value >= 1, got 0" in message
    assert "train.precision: expected one of fp32, bf16, fp16; got 'fp8'" in message


def test_all_problems_reported_together(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, "optim: {lrr: 1}\ndata: {batch_size: -1}\ntrain: {log_every: x}\n"))
    message = str(err.value)
    assert "3 problems" in message
    assert str(tmp_path / "exp.yaml") in message
    for path in ("optim.lrr", "data.batch_size", "train.log_every"):
        assert path in message


def test_bool_and_int_are_not_interchangeable(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, "ddp: {static_graph: 1}\ntrain: {epochs: true}\n"))
    assert "ddp.static_graph: expected true or false, got 1 (int)" in str(err.value)
    assert "train.epochs: expected an integer, got True (bool)" in str(err.value)


def test_section_must_be_a_mapping(tmp_path):
    with pytest.raises(ConfigError, match=r"optim: expected a mapping of keys for this section, got 'adam' \(str\)"):
        load_config(write(tmp_path, "optim: adam\n"))


def test_empty_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="is empty"):
        load_config(write(tmp_path, "# nothing here\n"))


def test_overrides_parse_yaml_scalars_and_win_over_the_file(tmp_path):
    path = write(tmp_path, "optim: {lr: 0.5}\ntrain: {epochs: 4}\n")
    cfg = load_config(
        path,
        [
            "optim.lr=0.25",
            "train.max_steps=7",
            "ddp.static_graph=true",
            "model.kwargs.hidden=[8, 8]",
            "train.clip_grad_norm=null",
        ],
    )
    assert cfg.optim.lr == 0.25  # CLI beats file
    assert cfg.train.epochs == 4  # file beats default
    assert cfg.train.max_steps == 7 and cfg.ddp.static_graph is True
    assert cfg.model.kwargs == {"hidden": [8, 8]}
    assert cfg.train.clip_grad_norm is None
    assert cfg.data.batch_size == 32  # default


def test_bad_overrides(tmp_path):
    path = write(tmp_path, "optim: {name: sgd}\n")
    with pytest.raises(ConfigError, match=r"bad override 'optim\.lr': expected dotted.key=value"):
        load_config(path, ["optim.lr"])
    with pytest.raises(ConfigError, match=r"bad override 'optim\.name\.x=1': optim\.name is 'sgd', not a section"):
        load_config(path, ["optim.name.x=1"])
    with pytest.raises(ConfigError, match=r"optim\.lt: unknown key; did you mean 'optim\.lr'"):
        load_config(path, ["optim.lt=0.1"])


def test_parse_override():
    assert parse_override("a.b=3") == (["a", "b"], 3)
    assert parse_override("a=x=y") == (["a"], "x=y")
    assert parse_override("a.b=") == (["a", "b"], None)
    with pytest.raises(ConfigError):
        parse_override("a..b=1")


def test_cross_field_checks(tmp_path):
    neither = load_config({"train": {"epochs": None}}).train  # neither epochs nor max_steps: one epoch (issue 44)
    assert (neither.epochs, neither.max_steps, neither.epoch_limit) == (None, None, 1)
    with pytest.raises(ConfigError, match="adam has no momentum argument; set optim.kwargs.betas"):
        load_config({"optim": {"name": "adam", "momentum": 0.9}})


def test_dump_roundtrip_and_stable_hash(tmp_path):
    cfg = load_config(
        {"data": {"name": "digits"}, "checkpoint": {"async": True, "best": {"metric": "val_accuracy", "mode": "max"}}}
    )
    text = dump_config(cfg)
    assert "async: true" in text
    again = load_config(yaml.safe_load(text))
    assert again == cfg
    assert config_hash(again) == config_hash(cfg)
    assert config_hash(load_config({"optim": {"lr": 0.2}})) != config_hash(cfg)


def test_cli_config_prints_resolved_config(tmp_path):
    """`ddpkit config` as a user types it: the override is parsed from the real command line and the resolved YAML must
    be all that reaches stdout."""
    path = write(tmp_path, "data: {name: digits}\n")
    done = run_cli("config", str(path), "optim.lr=0.3")
    assert done.returncode == 0, done.stderr
    resolved = yaml.safe_load(done.stdout)
    assert resolved["optim"]["lr"] == 0.3 and resolved["data"]["name"] == "digits" and resolved["run"]["name"] == "exp"


def test_cli_config_error_exits_2_without_traceback(tmp_path):
    path = write(tmp_path, "optim: {lrr: 0.1}\n")
    done = run_cli("config", str(path))
    assert done.returncode == 2
    assert "did you mean 'optim.lr'?" in done.stderr
    assert "Traceback" not in done.stderr


def test_hash_and_dump_accept_free_form_kwargs_with_mixed_key_types():
    cfg = load_config({"model": {"name": "mlp", "kwargs": {"hidden": {0: None, "async": None}}}})
    assert config_hash(cfg) == config_hash(load_config(yaml.safe_load(dump_config(cfg))))


SCIENTIFIC = {"3e-4": 3e-4, "1e-3": 1e-3, "1E5": 1e5, "-2.5e-3": -2.5e-3, "5e+2": 5e2, "1.0e5": 1e5}


@pytest.mark.parametrize("text, number", SCIENTIFIC.items())
def test_scientific_notation_in_a_file_is_a_float(tmp_path, text, number):
    positive = text.lstrip("-")  # the schema's numbers are >= 0; free-form kwargs take any sign
    cfg = load_config(
        write(
            tmp_path,
            f"optim: {{weight_decay: {positive}}}\nsched: {{min_lr: {positive}}}\nmodel: {{kwargs: {{x: {text}}}}}\n",
        )
    )
    assert cfg.optim.weight_decay == abs(number) and isinstance(cfg.optim.weight_decay, float)
    assert cfg.sched.min_lr == abs(number)
    assert cfg.model.kwargs["x"] == number and isinstance(cfg.model.kwargs["x"], float)


@pytest.mark.parametrize("text, number", SCIENTIFIC.items())
def test_scientific_notation_in_an_override_is_a_float(tmp_path, text, number):
    positive = text.lstrip("-")
    cfg = load_config(
        write(tmp_path, "optim: {lr: 0.1}\n"),
        [f"optim.weight_decay={positive}", "optim.lr=3e-4", f"model.kwargs.x={text}"],
    )
    assert cfg.optim.weight_decay == abs(number) and cfg.optim.lr == 3e-4
    assert cfg.model.kwargs["x"] == number


def test_scientific_notation_spelling_does_not_change_the_config_or_its_hash(tmp_path):
    spelled = load_config(write(tmp_path, "optim: {lr: 3e-4, weight_decay: 1E-2}\n", "a.yaml"))
    decimal = load_config(write(tmp_path, "optim: {lr: 0.0003, weight_decay: 0.01}\n", "a.yaml"))
    overridden = load_config(
        write(tmp_path, "optim: {lr: 0.1}\n", "a.yaml"), ["optim.lr=3.0e-4", "optim.weight_decay=1e-2"]
    )
    assert spelled == decimal == overridden
    assert config_hash(spelled) == config_hash(decimal) == config_hash(overridden)
    reloaded = load_config(write(tmp_path, dump_config(spelled), "a.yaml"))
    assert reloaded == spelled and config_hash(reloaded) == config_hash(spelled)


def test_scientific_notation_for_int_fields_must_be_whole(tmp_path):
    cfg = load_config(write(tmp_path, "train: {epochs: null, max_steps: 1e5}\n"), ["data.batch_size=3.2e1"])
    assert cfg.train.max_steps == 100_000 and isinstance(cfg.train.max_steps, int)
    assert cfg.data.batch_size == 32
    with pytest.raises(ConfigError, match=r"train\.max_steps: expected an integer, got '1e-3' \(str\)"):
        load_config(write(tmp_path, "train: {epochs: null, max_steps: 1e-3}\n"))


def test_scientific_notation_text_stays_text_where_a_string_is_expected(tmp_path):
    cfg = load_config(
        write(tmp_path, "run: {name: 1e3}\nmodel: {kwargs: {tag: '2e5', eps: 1e-8}}\n"), ["run.output_dir=5e2"]
    )
    assert cfg.run.name == "1e3" and cfg.run.output_dir == "5e2"
    # quoted stays text; unquoted in free-form kwargs is a number
    assert cfg.model.kwargs == {"tag": "2e5", "eps": 1e-8}
    reloaded = load_config(write(tmp_path, dump_config(cfg), "again.yaml"))
    assert reloaded == cfg and reloaded.model.kwargs["tag"] == "2e5"


def test_scientific_notation_keeps_the_safe_loader(tmp_path):
    with pytest.raises(ConfigError, match="Python object tag"):
        load_config(write(tmp_path, "optim: {lr: !!python/object/apply:os.system ['true']}\n"))
    with pytest.raises(ConfigError, match="not a YAML value"):
        load_config(write(tmp_path, "optim: {lr: 0.1}\n"), ["optim.lr=[1e-3"])
