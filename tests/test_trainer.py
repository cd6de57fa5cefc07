"""The Trainer in a world of one (plain python, no launcher): outputs, subclassing, steps, errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from helpers import assert_bitwise_equal, load_weights, tiny_config
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit import ConfigError, DdpkitError, load_config
from ddpkit.models.builtin import MLP


def test_single_process_run_writes_config_metrics_and_a_plain_state_dict(tmp_path):
    cfg = tiny_config(tmp_path, train={"epochs": 3, "log_every": 4})
    metrics = ddpkit.Trainer(cfg).fit()
    run = tmp_path / "run"

    assert metrics["step"] == 3 * 16 and metrics["epoch"] == 3
    assert 0.0 <= metrics["val_accuracy"] <= 1.0 and metrics["val_loss"] > 0
    assert load_config(yaml.safe_load((run / "config.yaml").read_text())) == load_config(cfg)

    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_losses = [r["train_loss"] for r in records if "train_loss" in r]
    assert {"step", "epoch", "train_loss", "lr", "samples_per_s", "time"} <= records[0].keys()
    assert train_losses[-1] < train_losses[0]  # it learns
    assert sum("val_accuracy" in r for r in records) == 3  # one evaluation per epoch

    weights = torch.load(run / "model.pt", weights_only=True)
    assert not any(key.startswith("module.") for key in weights)
    bare = MLP(in_features=144, hidden=[32])
    bare.load_state_dict(weights)  # strict: the bare model takes it as is


def test_same_seed_same_weights(tmp_path):
    ddpkit.Trainer(tiny_config(tmp_path / "a")).fit()
    ddpkit.Trainer(tiny_config(tmp_path / "b")).fit()
    ddpkit.Trainer(tiny_config(tmp_path / "c", run={"seed": 1})).fit()
    a, b, c = (load_weights(tmp_path / x / "run" / "model.pt") for x in "abc")
    assert_bitwise_equal(a, b)
    assert not torch.equal(a["net.1.weight"], c["net.1.weight"])


class Regression(ddpkit.Trainer):
    """Overrides every builder: needs no model / data / optim entries in the config."""

    def build_model(self):
        return nn.Linear(3, 1)

    def build_datasets(self):
        x = torch.randn(64, 3, generator=torch.Generator().manual_seed(0))
        return TensorDataset(x, x.sum(1, keepdim=True)), None

    def build_optimizer(self, model):
        return torch.optim.SGD(model.parameters(), lr=0.1)

    def training_step(self, batch):
        x, y = batch
        assert isinstance(self.model, nn.Linear) and self.world_size == 1 and self.is_main and self.rank == 0
        return F.mse_loss(self.model(x), y)


def test_subclass_needs_no_model_or_data_config(tmp_path):
    trainer = Regression(
        {
            "run": {"output_dir": str(tmp_path)},
            "data": {"batch_size": 8},
            "train": {"epochs": 20},
            "log": {"progress_bar": False},
            "checkpoint": {"every_epochs": None},
        }
    )
    metrics = trainer.fit()
    assert metrics["train_loss"] < 0.05
    assert trainer.device == torch.device("cpu")
    assert (tmp_path / "model.pt").exists()


def test_missing_model_name_says_what_to_do(tiny_cfg):
    tiny_cfg["model"] = {}
    with pytest.raises(ConfigError, match=r"model.name: not set; name a model .* or override build_model\(\)"):
        ddpkit.Trainer(tiny_cfg).fit()


def test_training_step_must_return_a_scalar(tiny_cfg):
    class Wrong(ddpkit.Trainer):
        def training_step(self, batch):
            x, y = batch
            return F.cross_entropy(self.model(x), y, reduction="none")

    with pytest.raises(
        DdpkitError, match=r"Wrong.training_step must return a scalar loss tensor, got a tensor of shape \(16,\)"
    ):
        Wrong(tiny_cfg).fit()


def test_precision_fp16_needs_cuda_and_bf16_runs_on_cpu(tmp_path):
    with pytest.raises(ConfigError, match="train.precision=fp16 needs a CUDA device.*use train.precision=bf16 or fp32"):
        ddpkit.Trainer(tiny_config(tmp_path, train={"precision": "fp16"})).fit()
    runs = {
        p: ddpkit.Trainer(tiny_config(tmp_path / p, train={"precision": p, "epochs": 1})).fit()
        for p in ("fp32", "bf16")
    }
    # bf16 keeps 8 bits of mantissa: after these 16 steps its validation loss is 0.5% from fp32's; allow 2%.
    assert runs["bf16"]["val_loss"] == pytest.approx(runs["fp32"]["val_loss"], rel=0.02)
    assert runs["bf16"]["val_loss"] < math.log(10)  # below chance (10 classes): it trained
    fp32, bf16 = (load_weights(tmp_path / p / "run/model.pt") for p in ("fp32", "bf16"))
    # bf16 really ran: not an fp32 run by another name
    assert any(not torch.equal(fp32[key], bf16[key]) for key in fp32)


def test_gradient_accumulation_equals_a_larger_batch(tmp_path):
    big = tiny_config(tmp_path / "big", data={"batch_size": 32}, optim={"momentum": 0.0})
    accum = tiny_config(
        tmp_path / "acc", data={"batch_size": 16}, optim={"momentum": 0.0}, train={"grad_accum_steps": 2}
    )
    assert ddpkit.Trainer(big).fit()["step"] == ddpkit.Trainer(accum).fit()["step"] == 16
    a, b = load_weights(tmp_path / "big/run/model.pt"), load_weights(tmp_path / "acc/run/model.pt")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6)


def test_max_steps_schedule_and_clipping(tmp_path):
    cfg = tiny_config(
        tmp_path,
        train={"epochs": None, "max_steps": 20, "clip_grad_norm": 0.5, "log_every": 5},
        sched={"name": "cosine", "warmup_steps": 5},
    )
    metrics = ddpkit.Trainer(cfg).fit()
    assert metrics["step"] == 20 and metrics["epoch"] == 1  # 16 steps per epoch: stopped inside epoch 2
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines() if "lr" in line]
    assert lrs[0] == pytest.approx(0.1) and lrs[-1] == pytest.approx(0.0)  # warmup done at 5, cosine to 0 at 20


def test_main_parses_config_and_overrides_and_exits_2_on_config_errors(tmp_path, capsys, tiny_yaml):
    ddpkit.Trainer.main([str(tiny_yaml), "train.epochs=1"])
    assert load_config(yaml.safe_load((tmp_path / "run/config.yaml").read_text())).train.epochs == 1
    with pytest.raises(SystemExit) as exit_info:
        ddpkit.Trainer.main([str(tiny_yaml), "optim.lrr=1"])
    assert exit_info.value.code == 2
    assert "did you mean 'optim.lr'?" in capsys.readouterr().err


def _group_threads() -> list[str]:
    """This process's Gloo threads (the backend's worker and transport threads, which torch names)."""
    names = []
    for task in Path("/proc/self/task").iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:
            pass  # the thread ended meanwhile
    return sorted(name for name in names if name.startswith(("pt_gloo", "gloo_")))


def test_fit_and_main_destroy_the_process_group_with_its_threads(tmp_path):
    # A group outliving fit() keeps its threads into interpreter shutdown, where one that takes the
    # GIL to free a tensor is ended by pthread_exit: std::terminate, SIGABRT after a finished run.
    before = _group_threads()
    trainer = ddpkit.Trainer(tiny_config(tmp_path / "fit", train={"epochs": 1}))
    trainer.fit()
    assert _group_threads() == before  # DDP held the group (and torch.distributed.nn's defaults could)
    assert trainer.model is trainer.unwrapped_model  # fit() let go of the wrapper; the weights stay
    path = tmp_path / "zero1.yaml"
    path.write_text(yaml.safe_dump(tiny_config(tmp_path / "zero1", train={"epochs": 1}, parallel={"mode": "zero1"})))
    ddpkit.Trainer.main([str(path)])
    assert _group_threads() == before  # the entry point frees the finished Trainer: its ZeRO optimizer held the group


def test_a_fresh_run_starts_metrics_afresh_and_a_resumed_run_appends(tmp_path):
    def logged_steps():
        lines = (tmp_path / "run/metrics.jsonl").read_text().splitlines()
        return [json.loads(line)["step"] for line in lines if "train_loss" in line]

    ddpkit.Trainer(tiny_config(tmp_path, train={"epochs": 2})).fit()
    assert logged_steps() == [4, 8, 12, 16, 20, 24, 28, 32]
    ddpkit.Trainer(tiny_config(tmp_path, train={"epochs": 1}, checkpoint={"resume": "none", "every_epochs": 1})).fit()
    assert logged_steps() == [4, 8, 12, 16]  # not the old run's steps 20..32
    ddpkit.Trainer(tiny_config(tmp_path, train={"epochs": 2}, checkpoint={"every_epochs": 1})).fit()
    assert logged_steps() == [4, 8, 12, 16, 20, 24, 28, 32]  # resumed at 16 and appended
