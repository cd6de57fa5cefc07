"""Pipeline parallelism (``parallel.pipeline``) on real Gloo ranks: P stages x M microbatches against a world of
one accumulating the same M microbatches, a user model cut by module names, checkpoints across layouts, and the
layouts that cannot work.

    .venv/bin/pytest -q tests/test_pipeline.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import (
    RaggedSequences,
    assert_bitwise_equal,
    assert_same_samples_after_restart,
    launch_with_a_restart,
    load_weights,
    run_in_pool,
)
from torch import nn

import ddpkit
from ddpkit.config.layout import check_layout, layout_problems
from ddpkit.config.loader import load_config
from ddpkit.errors import ConfigError
from ddpkit.testing import RankPool

pytestmark = pytest.mark.timeout(300)

SCRIPT = "tests/scripts/pipeline_trainer.py"


class RaggedTrainer(ddpkit.Trainer):
    def build_datasets(self):
        return RaggedSequences(n=64), None


def _config(out: Path, *, pipeline: int, microbatches: int, **extra) -> dict:
    """A tiny tied GPT on ragged token sequences, global batch 8: P stages x M microbatches, or M-way accumulation."""
    parallel = {"pipeline": pipeline, **extra.pop("parallel", {})}
    train = {"max_steps": 4, "log_every": 2, **extra.pop("train", {})}
    if pipeline > 1:
        parallel["microbatches"] = microbatches
    else:
        train["grad_accum_steps"] = microbatches
    return {
        "run": {"name": "pp", "output_dir": str(out), "seed": 3},
        "data": {"global_batch_size": 8, "order": "index_free"},
        "model": {"name": "gpt", "kwargs": {"vocab_size": 50, "dim": 32, "depth": 4, "heads": 2, "max_len": 16}},
        "optim": {"name": "sgd", "lr": 0.5},
        "train": train,
        "parallel": parallel,
        "checkpoint": {"every_epochs": None, **extra.pop("checkpoint", {})},
        "log": {"progress_bar": False},
        **extra,
    }


def _fit(cfg: dict, trainer_class: type = RaggedTrainer) -> dict:
    trainer = trainer_class(cfg)
    metrics = trainer.fit()
    return {"metrics": metrics, "weights": {k: v.clone() for k, v in trainer.placed.held.state_dict().items()}}


def _merged(results: list[dict]) -> dict[str, torch.Tensor]:
    """Every stage's parameters, by the whole model's names."""
    merged: dict[str, torch.Tensor] = {}
    for result in results:
        merged.update(result["weights"])
    return merged


def _relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-12)) for k in a)


def _schedules_against_accumulation(tmp: Path) -> dict:
    out = {}
    for name, parallel in {
        "gpipe": {"schedule": "gpipe"},
        "1f1b": {"schedule": "1f1b"},
        "interleaved": {"schedule": "interleaved_1f1b", "stages_per_rank": 2},
    }.items():
        out[name] = _fit(_config(tmp / name, pipeline=2, microbatches=4, parallel=parallel))
    out["tokens"] = _fit(_config(tmp / "tokens", pipeline=2, microbatches=4, train={"loss_normalization": "tokens"}))
    return out


def _one(cfg: dict) -> dict:
    return _fit(cfg)


@pytest.mark.multiprocess
def test_two_stages_match_a_world_of_one_accumulating_the_same_microbatches(tmp_path):
    reference = run_in_pool(_one, 1, args=(_config(tmp_path / "one", pipeline=1, microbatches=4),), timeout=120)[0]
    tokens_cfg = _config(tmp_path / "one-tokens", pipeline=1, microbatches=4, train={"loss_normalization": "tokens"})
    by_tokens = run_in_pool(_one, 1, args=(tokens_cfg,), timeout=120)[0]
    results = run_in_pool(_schedules_against_accumulation, 2, args=(tmp_path,), timeout=240)
    for name in ("gpipe", "1f1b", "interleaved", "tokens"):
        expected = by_tokens if name == "tokens" else reference
        stages = [result[name] for result in results]
        # Not bitwise: the tied embedding's two gradients (first and last stage) are added in another order
        # than one process's autograd adds them (docs/modes.md#pipelines).
        assert _relative(_merged(stages), expected["weights"]) < 1e-6, name
        for stage in stages:
            loss = stage["metrics"]["train_loss"]
            assert loss == pytest.approx(expected["metrics"]["train_loss"], rel=1e-6), name
            assert stage["metrics"]["step"] == 4


class PackedTrainer(ddpkit.Trainer):
    """Ragged sequences read as packed windows: token 7 ends a document (a few in each window), and the model
    attends within each document, its positions restarted there (``data.kwargs.document_mask``'s setting, handed
    to the model as the tokens dataset hands it); validated on 21 more."""

    def build_datasets(self):
        return RaggedSequences(n=64), RaggedSequences(n=21)

    def build_model(self):
        model = super().build_model()
        model.use_documents(eot=7, restart_positions=True)
        return model


LLAMA = {"arch": "llama", "vocab_size": 50, "dim": 32, "depth": 4, "heads": 4, "kv_heads": 2, "mlp_dim": 64}


def _masked(tmp: Path, pipeline: int) -> dict:
    """GPT-2 (learned positions, a tied head) and Llama (RoPE, untied) with the document mask, validated at step 2;
    under a pipeline GPT-2 with fsdp2 inside too."""
    llama = {"model": {"name": "gpt", "kwargs": {**LLAMA, "tied": False}}}
    runs = {"gpt": {}, "llama": llama, "gpt-fsdp2": {"parallel": {"mode": "fsdp2"}}}
    out = {}
    for name, extra in runs.items():
        if pipeline == 1 and name == "gpt-fsdp2":
            continue
        train = {"max_steps": 2, "eval_every": 2}
        cfg = _config(tmp / f"{name}-{pipeline}", pipeline=pipeline, microbatches=4, train=train, **extra)
        cfg["data"]["val_batch_size"] = 3
        result = _fit(cfg, PackedTrainer)
        # fsdp2's shards (of one replica here) as whole tensors
        weights = result["weights"].items()
        result["weights"] = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in weights}
        out[name] = result
    return out


@pytest.mark.multiprocess
def test_the_document_mask_under_two_stages_trains_and_validates_like_a_world_of_one(tmp_path):
    """Every stage finds the documents in the microbatch's token ids (the step passes them to each stage's forward):
    the same masked attention and restarted positions as one process accumulating the same microbatches."""
    one = run_in_pool(_masked, 1, args=(tmp_path, 1), timeout=120)[0]
    results = run_in_pool(_masked, 2, args=(tmp_path, 2), timeout=240)
    for name in ("gpt", "llama", "gpt-fsdp2"):
        stages = [result[name] for result in results]
        merged = _merged(stages)
        reference = one[name.removesuffix("-fsdp2")]
        if name == "llama":
            # Untied: the same arithmetic as one process, in the same order.
            assert_bitwise_equal(merged, reference["weights"])
        else:
            # The tied matrix's two gradients are added in another order than one process's autograd adds them.
            assert _relative(merged, reference["weights"]) < 1e-6, name
        for metric in ("train_loss", "val_loss"):
            expected = reference["metrics"][metric]
            assert stages[-1]["metrics"][metric] == pytest.approx(expected, rel=1e-6), (name, metric)
    # The mask is on: without it the same runs end elsewhere.
    assert one["gpt"]["metrics"]["train_loss"] != pytest.approx(_unmasked_loss(tmp_path), rel=1e-6)


def _unmasked_loss(tmp: Path) -> float:
    cfg = _config(tmp / "unmasked", pipeline=1, microbatches=4, train={"max_steps": 2, "eval_every": 2})
    cfg["data"]["val_batch_size"] = 3
    return run_in_pool(_fit, 1, args=(cfg, RaggedTrainer), timeout=120)[0]["metrics"]["train_loss"]


class Mlp(ddpkit.Trainer):
    """A user's model: an nn.Sequential cut by module names (untied: the same arithmetic as one process)."""

    def build_model(self):
        layers = [nn.Linear(144, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)]
        return nn.Sequential(nn.Flatten(), *layers)


def _mlp_config(out: Path, *, pipeline: int) -> dict:
    cfg = {
        "run": {"name": "mlp", "output_dir": str(out), "seed": 0},
        "data": {"name": "digits", "global_batch_size": 32, "kwargs": {"num_train": 256, "image_size": 12}},
        "optim": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
        "train": {"max_steps": 6, "log_every": 3},
        "checkpoint": {"every_epochs": None, "every_steps": 3},
        "log": {"progress_bar": False},
    }
    if pipeline > 1:
        cfg["parallel"] = {"pipeline": 2, "microbatches": 4, "split_points": ["3"], "schedule": "gpipe"}
    else:
        cfg["train"]["grad_accum_steps"] = 4
    return cfg


def _fit_mlp(cfg: dict) -> dict:
    return _fit(cfg, Mlp)


@pytest.mark.multiprocess
def test_a_user_model_cut_by_module_names_trains_bitwise_like_one_process_and_writes_the_whole_model(tmp_path):
    one = run_in_pool(_fit_mlp, 1, args=(_mlp_config(tmp_path / "one", pipeline=1),), timeout=120)[0]
    stages = run_in_pool(_fit_mlp, 2, args=(_mlp_config(tmp_path / "pp", pipeline=2),), timeout=120)
    assert set(stages[0]["weights"]) == {"1.weight", "1.bias"}
    assert_bitwise_equal(_merged(stages), one["weights"])
    # model.pt holds the whole model under its own names, whatever the layout
    assert_bitwise_equal(load_weights(tmp_path / "pp/model.pt"), load_weights(tmp_path / "one/model.pt"))
    # the checkpoints are DCP directories every stage wrote its part of
    assert (tmp_path / "pp/checkpoints/step-000000006.dcp").is_dir()


def _resume_pp_then_one(tmp: Path) -> dict:
    cfg = _mlp_config(tmp / "pp", pipeline=2)
    cfg["train"]["max_steps"] = 3
    return _fit(cfg, Mlp)


@pytest.mark.multiprocess
def test_a_pipeline_checkpoint_resumes_in_a_world_of_one_with_the_same_samples(tmp_path):
    straight = run_in_pool(_fit_mlp, 1, args=(_mlp_config(tmp_path / "straight", pipeline=1),), timeout=120)[0]
    run_in_pool(_resume_pp_then_one, 2, args=(tmp_path,), timeout=120)
    # The same run directory, now a world of one with 4-way accumulation: steps 4..6 from the pp2 checkpoint.
    cfg = _mlp_config(tmp_path / "pp", pipeline=1)
    resumed = run_in_pool(_fit_mlp, 1, args=(cfg,), timeout=120)[0]
    assert resumed["metrics"]["step"] == 6
    assert_bitwise_equal(resumed["weights"], straight["weights"])


def test_layouts_that_cannot_work_are_refused_before_any_group_naming_the_valid_ones():
    cfg = load_config({"parallel": {"pipeline": 3}})
    with pytest.raises(ConfigError, match=r"3 stages do not divide the world size 4; valid on 4 ranks: pipeline=1"):
        check_layout(cfg.parallel, world_size=4)
    few = load_config({"parallel": {"pipeline": 4, "microbatches": 2}})
    assert "1f1b needs at least as many microbatches as stages (4)" in layout_problems(few.parallel, world_size=4)[0]
    with pytest.raises(ConfigError, match="set train.grad_accum_steps=1 and parallel.microbatches=4"):
        load_config({"parallel": {"pipeline": 2}, "train": {"grad_accum_steps": 4}})
    with pytest.raises(ConfigError, match="parallel.stages_per_rank=2"):
        load_config({"parallel": {"pipeline": 2, "schedule": "interleaved_1f1b"}})
    with pytest.raises(ConfigError, match="only with parallel.pipeline > 1"):
        load_config({"parallel": {"microbatches": 4}})
    # generation needs every stage on one rank: refused before setup, not found failing after it
    with pytest.raises(ConfigError, match="train.sample: generation needs the whole model on one rank"):
        load_config({"parallel": {"pipeline": 2}, "train": {"sample": {"every_steps": 10}}})
    # fsdp2 inside a pipeline runs (tests/test_pipeline_fsdp.py)
    assert load_config({"parallel": {"pipeline": 2, "mode": "fsdp2"}}).parallel.mode == "fsdp2"
    # and beside tensor parallelism: dp x pp x tp (tests/test_tensor_training.py, 8 ranks)
    three_d = load_config({"parallel": {"pipeline": 2, "mode": "fsdp2", "tensor": 2}})
    check_layout(three_d.parallel, world_size=8)


class OwnStep(RaggedTrainer):
    def training_step(self, batch):
        return super().training_step(batch)


def _own_step(cfg: dict) -> str:
    try:
        OwnStep(cfg).fit()
    except ConfigError as error:
        return str(error)
    return "no error"


@pytest.mark.multiprocess
def test_a_subclass_overriding_training_step_is_told_to_override_pipeline_loss(tmp_path):
    messages = run_in_pool(_own_step, 2, args=(_config(tmp_path, pipeline=2, microbatches=2),), timeout=120)
    assert all("override pipeline_loss(output, target) instead" in message for message in messages)


def _launch(out: Path, env: dict[str, str]) -> str:
    cfg = _mlp_config(out / "run", pipeline=2)
    cfg["train"]["max_steps"] = 12
    cfg["data"]["kwargs"]["num_train"] = 512
    return launch_with_a_restart(out, cfg, script=SCRIPT, nproc=4, env=env)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_pp2_x_dp2_killed_resumes_bitwise_with_the_same_samples(tmp_path):
    """`ddpkit run`'s own restart (`--max-restarts 1`) after rank 2 SIGKILLs itself, on four pipelined ranks."""
    _launch(tmp_path / "clean", {})
    stderr = _launch(tmp_path / "killed", {"KILL_RANK": "2", "KILL_AT_STEP": "5"})
    assert "crash save and memory snapshots are off under a pipeline" in stderr
    # The last stage of each replica logged its targets: ranks 2 and 3 (pp rank 1, replicas 0 and 1).
    for rank in (2, 3):
        assert_same_samples_after_restart(tmp_path / "killed/run", tmp_path / "clean/run", rank, resumed_at=4)
    assert_bitwise_equal(load_weights(tmp_path / "killed/run/model.pt"), load_weights(tmp_path / "clean/run/model.pt"))


@pytest.mark.multiprocess
def test_a_world_of_one_checkpoint_resumes_as_a_pipeline_with_the_same_samples(tmp_path):
    straight = run_in_pool(_fit_mlp, 1, args=(_mlp_config(tmp_path / "straight", pipeline=1),), timeout=120)[0]
    first = _mlp_config(tmp_path / "run", pipeline=1)
    first["train"]["max_steps"] = 3
    run_in_pool(_fit_mlp, 1, args=(first,), timeout=120)
    # A single file, its optimizer state keyed by position in the whole model: each stage takes its own part.
    stages = run_in_pool(_fit_mlp, 2, args=(_mlp_config(tmp_path / "run", pipeline=2),), timeout=120)
    assert stages[0]["metrics"]["step"] == 6
    assert_bitwise_equal(_merged(stages), straight["weights"])


def test_a_model_placed_by_hand_on_two_devices_stays_where_it_is():
    from helpers import cpu_runtime

    from ddpkit.config.schema import DDPConfig
    from ddpkit.distributed.ddp import devices_of, wrap_model

    # The meta device stands in for a second GPU: nothing is computed, only where the parameters live.
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2).to("meta"))
    assert devices_of(model) == {torch.device("cpu"), torch.device("meta")}
    wrapped = wrap_model(model, cpu_runtime(world_size=1), DDPConfig())
    assert devices_of(wrapped) == {torch.device("cpu"), torch.device("meta")}


def _pp2_x_dp2(tmp: Path) -> dict:
    out = {}
    for mode in ("ddp", "zero1"):
        # The replica check compares each stage with its own replica, never stage 0 with stage 1.
        health = {"check_replicas_every": 2, "on_divergence": "stop"}
        cfg = _config(tmp / mode, pipeline=2, microbatches=2, parallel={"mode": mode}, health=health)
        out[mode] = _fit(cfg)
    return out


@pytest.mark.multiprocess
def test_pp2_x_dp2_matches_a_world_of_one_accumulating_dp_x_m_microbatches(tmp_path):
    # 2 replicas x 2 microbatches each: the 4 microbatches a world of one accumulates, in the same order.
    reference = run_in_pool(_one, 1, args=(_config(tmp_path / "one", pipeline=1, microbatches=4),), timeout=120)[0]
    results = run_in_pool(_pp2_x_dp2, 4, args=(tmp_path,), timeout=300)
    for mode in ("ddp", "zero1"):
        # ranks 0 and 1 are stage 0 (replicas 0 and 1), ranks 2 and 3 stage 1
        assert_bitwise_equal(results[0][mode]["weights"], results[1][mode]["weights"])
        merged = _merged([results[0][mode], results[2][mode]])
        assert _relative(merged, reference["weights"]) < 1e-6, mode


def _pp2_x_tp2(tmp: Path) -> dict:
    result = _fit(_config(tmp, pipeline=2, microbatches=4, parallel={"tensor": 2}))
    result["weights"] = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in result["weights"].items()}
    return result


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_tied_head_under_pp2_x_tp2_sums_its_gradients_between_its_two_stages(tmp_path):
    reference = run_in_pool(_one, 1, args=(_config(tmp_path / "one", pipeline=1, microbatches=4),), timeout=120)[0]
    # ranks 0 and 1 are stage 0 (tensor ranks 0 and 1), ranks 2 and 3 stage 1: the tied matrix's pairs are (0, 2) and
    # (1, 3), the same tensor coordinate on the first and last stage (a pair of one stage's tensor ranks: 0.28 off).
    results = run_in_pool(_pp2_x_tp2, 4, args=(tmp_path / "pp",), timeout=240)
    assert _relative(_merged([results[0], results[2]]), reference["weights"]) < 1e-6
    assert_bitwise_equal(results[0]["weights"], results[1]["weights"])


def _pp2_x_tp2_after_other_groups(tmp: Path) -> dict:
    for _ in range(15):
        torch.distributed.new_group([0, 1, 2, 3])
    return _pp2_x_tp2(tmp)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_pooled_rank_runs_pp2_x_tp2_after_a_function_that_named_its_groups_otherwise(tmp_path):
    """The rank pool's reset: DTensor caches sharding by mesh, and meshes of the same ranks and names compare equal
    whatever their groups, so without clearing those caches the second run's embedding output was laid out on the
    first run's mesh, whose groups were gone ("Could not resolve the process group registered under the name 19",
    seen in CI after another file's 4-rank function)."""
    with RankPool(4) as pool:
        first = pool.run(_pp2_x_tp2_after_other_groups, args=(tmp_path / "first",), timeout=240)
        second = pool.run(_pp2_x_tp2, args=(tmp_path / "second",), timeout=240)
    assert_bitwise_equal(first[0]["weights"], second[0]["weights"])


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("parallel.pipeline=3", "parallel.pipeline: 3 stages do not divide the world size 2; valid on 2 ranks"),
        ("parallel.tensor=2", "model.kwargs.heads"),
    ],
)
def test_ddpkit_run_refuses_an_impossible_layout_before_it_spawns_a_worker(tmp_path, override, named):
    """Issue 68: the launcher itself, not each of N workers once started: exit 2, the fix named, no rank's output."""
    from helpers import run_cli

    config = tmp_path / "pp.yaml"
    config.write_text(
        "model: {name: gpt, kwargs: {arch: llama, vocab_size: 257, dim: 48, depth: 4, heads: 3, kv_heads: 3, "
        "mlp_dim: 64, max_len: 16}}\n"
        "data: {name: tokens, global_batch_size: 8, kwargs: {corpus: stdlib, seq_len: 16}}\n"
        f"run: {{output_dir: {tmp_path / 'run'}}}\n"
    )
    done = run_cli("run", str(config), "--nproc-per-node", "2", override, timeout=60)
    assert done.returncode == 2, done.stderr
    assert named in done.stderr
    # nothing started: no rank logged, no run directory written
    assert "[rank" not in done.stderr and not (tmp_path / "run").exists()
