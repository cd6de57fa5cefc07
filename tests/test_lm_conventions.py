"""Language-model conventions (issue 44): train.max_steps alone runs exactly that many steps, weight decay
on matrices only by default, parameter groups from the config, and a one-group checkpoint of the
previous release resuming bitwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import run_in_pool, tiny_config

import ddpkit
from ddpkit import training
from ddpkit.checkpoint.files import load_checkpoint, save_checkpoint
from ddpkit.config.loader import load_config
from ddpkit.errors import ConfigError
from ddpkit.models.gpt import GPT
from ddpkit.training.param_groups import param_groups

STEPS_PER_EPOCH = 16  # tiny_config: 256 digits in batches of 16


class NamedGroups(ddpkit.Trainer):
    """Builds the optimizer from the model, so optim.groups can select parameters by name; keeps the initial weights."""

    def build_model(self):
        model = super().build_model()
        self.initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return model

    def build_optimizer(self, model):
        return training.build_optimizer(model, self.config.optim)


@pytest.mark.parametrize(
    ("train", "steps", "epoch"),
    [
        ({"epochs": None, "max_steps": 40}, 40, 2),  # max_steps alone: 2.5 epochs, exactly 40 steps
        ({"epochs": None, "max_steps": None}, STEPS_PER_EPOCH, 1),  # neither: one epoch
        ({"epochs": 1, "max_steps": 40}, STEPS_PER_EPOCH, 1),  # both: whichever comes first
        ({"epochs": 3, "max_steps": 20}, 20, 1),
    ],
)
def test_max_steps_alone_trains_exactly_that_many_steps_across_epochs(tmp_path, train, steps, epoch):
    cfg = tiny_config(tmp_path, train={**train, "log_every": 100}, sched={"name": "cosine", "min_lr": 0.001})
    cfg["train"] = {k: v for k, v in cfg["train"].items() if v is not None or k in train}
    trainer = ddpkit.Trainer(cfg)
    metrics = trainer.fit()
    assert (metrics["step"], metrics["epoch"], trainer.total_steps) == (steps, epoch, steps)
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.001)  # the cosine spans the whole run


def test_the_default_train_section_is_one_epoch_and_max_steps_lifts_it():
    assert load_config({}).train.epoch_limit == 1
    assert load_config({"train": {"max_steps": 2000}}).train.epoch_limit is None


def _gpt() -> GPT:
    return GPT(vocab_size=32, dim=16, depth=2, heads=2, max_len=8)


def _names(model, group) -> set[str]:
    return {name for name, p in model.named_parameters() if any(p is q for q in group["params"])}


def test_weight_decay_applies_to_matrices_only_by_default_and_to_all_with_decay_all():
    model = _gpt()
    groups = param_groups(list(model.named_parameters()), load_config({"optim": {"weight_decay": 0.1}}).optim)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert _names(model, groups[0]) == {
        "embed.weight",
        "pos.weight",
        *(f"blocks.{i}.{m}.weight" for i in range(2) for m in ("attn.qkv", "attn.proj", "fc", "proj")),
    }
    assert all(name.endswith("bias") or ".ln" in name or name.startswith("ln_f") for name in _names(model, groups[1]))
    every = param_groups(
        list(model.named_parameters()), load_config({"optim": {"weight_decay": 0.1, "decay": "all"}}).optim
    )
    assert len(every) == 1 and every[0]["params"] == list(model.parameters())
    none = param_groups(list(model.named_parameters()), load_config({}).optim)  # no decay: one group in model order
    assert len(none) == 1 and none[0]["params"] == list(model.parameters())


def test_groups_select_by_fnmatch_or_regex_first_match_wins_and_set_lr_and_decay():
    model = _gpt()
    optim = load_config(
        {
            "optim": {
                "name": "adamw",
                "lr": 0.01,
                "weight_decay": 0.1,
                "groups": [
                    {"params": ["embed.*", "pos.*"], "lr": 0.001},
                    {"params": ["re:^blocks\\.1\\."], "weight_decay": 0.0},
                    {"params": ["blocks.*"], "lr": 0.02, "weight_decay": 0.5},
                ],
            }
        }
    ).optim
    optimizer = training.build_optimizer(model, optim)
    by_names = {frozenset(_names(model, g)): (g["lr"], g["weight_decay"]) for g in optimizer.param_groups}
    assert by_names[frozenset({"embed.weight", "pos.weight"})] == (0.001, 0.1)
    assert by_names[frozenset(n for n, _ in model.named_parameters() if n.startswith("blocks.1."))] == (0.01, 0.0)
    assert by_names[frozenset(n for n, _ in model.named_parameters() if n.startswith("blocks.0."))] == (0.02, 0.5)
    assert by_names[frozenset({"ln_f.weight", "ln_f.bias"})] == (0.01, 0.0)  # ungrouped, 1-D: no decay
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(list(model.parameters()))


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        ([{"params": ["ln1.*"]}], r"optim.groups\[0\].params: 'ln1.\*' matches no parameter.*'\*.qkv.\*'"),
        (
            [{"params": ["re:(unclosed"]}],
            r"optim.groups\[0\].params: 're:\(unclosed' is not a valid regular expression",
        ),
        ([{"params": []}], r"optim.groups\[0\].params: the group selects no parameters"),
    ],
)
def test_group_mistakes_are_one_line_naming_the_entry(groups, message):
    with pytest.raises(ConfigError, match=message):
        training.build_optimizer(_gpt(), load_config({"optim": {"groups": groups}}).optim)


def test_groups_need_names_so_bare_parameters_are_refused_with_the_fix():
    with pytest.raises(
        ConfigError, match=r"optim.groups: selecting parameters by name needs the model.*build_optimizer\(model"
    ):
        training.build_optimizer(_gpt().parameters(), load_config({"optim": {"groups": [{"params": ["*"]}]}}).optim)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def _as_written_by_the_previous_release(path: Path) -> None:
    """The checkpoint's saved config without the keys that release did not have (its optimizer had one group)."""
    state = load_checkpoint(path)
    for key in ("decay", "groups"):
        del state["config"]["optim"][key]
    meta = json.loads(path.with_suffix(".json").read_text())
    save_checkpoint(
        state, path.parent, step=meta["step"], meta={k: meta[k] for k in ("epoch", "config_hash", "versions")}
    )


def test_a_one_group_checkpoint_of_the_previous_release_resumes_bitwise_as_one_group(tmp_path, capfd):
    """decay: all is exactly the previous release's optimizer (one group, every parameter decayed)."""
    old = {"name": "adamw", "lr": 0.01, "momentum": 0.0, "weight_decay": 0.1, "decay": "all"}
    common = {"checkpoint": {"every_steps": 4}, "train": {"epochs": None, "max_steps": 8}}
    ddpkit.Trainer(tiny_config(tmp_path / "ref", optim=old, **common)).fit()
    ddpkit.Trainer(
        tiny_config(tmp_path / "cut", optim=old, checkpoint={"every_steps": 4}, train={"epochs": None, "max_steps": 4})
    ).fit()
    _as_written_by_the_previous_release(tmp_path / "cut/run/checkpoints/step-000000004.pt")
    new = {"name": "adamw", "lr": 0.01, "momentum": 0.0, "weight_decay": 0.1}  # today's default: two groups
    capfd.readouterr()
    resumed = ddpkit.Trainer(tiny_config(tmp_path / "cut", optim=new, **common))
    resumed.fit()
    lines = [line for line in capfd.readouterr().err.splitlines() if "parameter group" in line]
    assert [line.split(" ", 3)[-1] for line in lines] == [
        "optimizer: the checkpoint holds one parameter group (written before optim.decay / optim.groups); "
        "resuming it as one group, as it was trained. A new run uses the configured groups"
    ]
    assert len(resumed.optimizer.param_groups) == 1 and resumed.progress.step == 8
    ref, got = _weights(tmp_path / "ref/run/model.pt"), _weights(tmp_path / "cut/run/model.pt")
    assert all(torch.equal(ref[k], got[k]) for k in ref)


def _groups_in_modes(out: str) -> dict[str, tuple[int, float, float]]:
    """Rank r: a byte GPT trained 3 steps with a near-zero lr group on the embeddings, in each parallel mode:
    (groups, largest change of the embeddings, of an MLP weight)."""
    results = {}
    for mode in ("ddp", "zero1", "fsdp2"):
        trainer = NamedGroups(
            {
                "run": {"output_dir": f"{out}/{mode}", "seed": 0},
                "log": {"progress_bar": False},
                "dist": {"timeout": 60},
                "model": {
                    "name": "gpt",
                    "kwargs": {"vocab_size": 257, "dim": 32, "depth": 2, "heads": 4, "max_len": 32},
                },
                "data": {"name": "tokens", "batch_size": 4, "kwargs": {"corpus": "stdlib", "seq_len": 32}},
                "optim": {
                    "name": "adamw",
                    "lr": 1e-2,
                    "weight_decay": 0.1,
                    "groups": [{"params": ["embed.*", "pos.*"], "lr": 1e-9}],
                },
                "parallel": {"mode": mode},
                "train": {"max_steps": 3, "eval_every": 100},
                "checkpoint": {"every_steps": None},
            }
        )
        trainer.fit()
        final = torch.load(f"{out}/{mode}/model.pt", weights_only=True)
        change = {k: (final[k] - trainer.initial[k]).abs().max().item() for k in ("embed.weight", "blocks.0.fc.weight")}
        results[mode] = (len(trainer.optimizer.param_groups), change["embed.weight"], change["blocks.0.fc.weight"])
    return results


@pytest.mark.multiprocess
@pytest.mark.slow
def test_groups_take_effect_under_ddp_zero1_and_fsdp2_on_two_ranks(tmp_path):
    results = run_in_pool(_groups_in_modes, 2, args=(str(tmp_path),), timeout=300)
    assert results[0] == results[1]
    for mode, (groups, embed, fc) in results[0].items():
        assert groups == 3, mode  # decayed, undecayed, the embeddings' group
        assert embed < 1e-6 < 1e-3 < fc, (mode, embed, fc)  # lr 1e-9 for the embeddings, 1e-2 elsewhere


def _sharded_resumes(out: str) -> dict[str, object]:
    """Rank r: a one-group (decay: all) fsdp2 / zero1 checkpoint resumed with today's two groups; a two-group ddp
    checkpoint resumed as fsdp2. Each against an uninterrupted run of the mode it ends in."""
    old = {"name": "adamw", "lr": 0.01, "momentum": 0.0, "weight_decay": 0.1, "decay": "all"}
    new = {k: v for k, v in old.items() if k != "decay"}

    def run(name, optim, mode, steps, **checkpoint):
        trainer = ddpkit.Trainer(
            tiny_config(
                f"{out}/{name}",
                optim=optim,
                parallel={"mode": mode},
                checkpoint={"every_steps": 4, **checkpoint},
                train={"epochs": None, "max_steps": steps},
            )
        )
        trainer.fit()
        return trainer

    results = {}
    for first, then, before in (("fsdp2", "fsdp2", old), ("ddp", "fsdp2", new), ("zero1", "zero1", old)):
        key = f"{first}->{then}"
        run(f"{key}/ref", before, then, 8)
        run(f"{key}/cut", before, first, 4)
        try:
            resumed = run(f"{key}/cut", new, then, 8, allow_config_change=True)
        except Exception as exc:  # zero1 cannot regroup: one line saying what to do
            results[key] = str(exc)
            continue
        a, b = (torch.load(f"{out}/{key}/{n}/run/model.pt", weights_only=True) for n in ("ref", "cut"))
        results[key] = (len(resumed.optimizer.param_groups), all(torch.equal(a[k], b[k]) for k in a))
    return results


@pytest.mark.multiprocess
@pytest.mark.slow
def test_sharded_checkpoints_resume_with_their_grouping_on_two_ranks(tmp_path):
    results = run_in_pool(_sharded_resumes, 2, args=(str(tmp_path),), timeout=500)[0]
    assert results["fsdp2->fsdp2"] == (1, True)  # the earlier release's one group, bitwise
    assert results["ddp->fsdp2"] == (2, True)  # today's two groups across modes, bitwise
    assert results["zero1->zero1"].startswith(
        "the checkpoint's optimizer has 1 parameter group(s), this zero1 run's has 2"
    )
