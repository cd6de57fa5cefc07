"""HSDP (``parallel.mode: fsdp2`` with ``parallel.replicate: R``): fsdp2 sharded within a group of dp / R ranks and
replicated across R such groups, on torch's ``fully_shard`` over a 2-D ``("dp_replicate", "dp_shard")`` mesh.

    .venv/bin/pytest -q tests/test_hsdp.py            # -m slow for the checkpoints across layouts

On one machine HSDP is 2 replicas x 2 shards on 4 Gloo ranks. What is checked: the refusals before any group, where
each rank sits and which ranks each collective of a step joins (torch's fake backend, every rank in this process),
what ``ddpkit estimate`` predicts, training against a world of one, and checkpoints written under HSDP resumed as
fsdp2 and as a world of one, and a ddp checkpoint resumed under HSDP, with the same samples.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import RaggedSequences, cpu_runtime, full_state, run_in_pool
from torch import nn

import ddpkit
from ddpkit.config.layout import check_layout
from ddpkit.config.loader import load_config
from ddpkit.errors import ConfigError
from ddpkit.parallel.layout import ParallelLayout
from ddpkit.testing import fake_ranks
from ddpkit.tools.estimate import estimate

pytestmark = pytest.mark.timeout(300)

HSDP = {"mode": "fsdp2", "replicate": 2}


def test_hsdp_layouts_that_cannot_work_are_refused_before_any_group_naming_the_fix():
    with pytest.raises(ConfigError, match=r"parallel.replicate: 2 replicas of fsdp2's shards \(HSDP\) need "):
        load_config({"parallel": {"replicate": 2}})
    with pytest.raises(ConfigError, match="set parallel.mode=fsdp2 or parallel.replicate=1"):
        load_config({"parallel": {"replicate": 2, "mode": "zero1"}})
    three = load_config({"parallel": {"mode": "fsdp2", "replicate": 3}})
    with pytest.raises(ConfigError, match=r"3 does not divide the data-parallel degree 4 .*; valid: 1, 2, 4"):
        check_layout(three.parallel, world_size=4)
    # beside tensor parallelism the data-parallel degree is world / (P x T): 8 / 2 = 4, so 4 replicas of 1 shard
    tp = load_config({"parallel": {"mode": "fsdp2", "replicate": 4, "tensor": 2}})
    check_layout(tp.parallel, world_size=8)
    with pytest.raises(ConfigError, match=r"4 does not divide the data-parallel degree 2 \(world size 4 / "):
        check_layout(tp.parallel, world_size=4)
    check_layout(load_config({"parallel": HSDP}).parallel, world_size=4)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8)), nn.Linear(8, 2))


def _collectives_of_one_step(parallel: dict, rank: int, monkeypatch: pytest.MonkeyPatch) -> dict:
    """Rank ``rank`` of 4, on the fake backend: its layout, its parameters' placements, and each collective one
    forward and backward of an fsdp2 model issue, with the ranks of the group it joins."""
    joined: list[tuple[str, tuple[int, ...]]] = []

    def spy(name: str):
        real = getattr(dist, name)

        def call(*args, group=None, **kwargs):
            joined.append((name, tuple(dist.get_process_group_ranks(group))))
            return real(*args, group=group, **kwargs)

        return call

    with fake_ranks(4, rank=rank), monkeypatch.context() as patch:
        cfg = load_config({"parallel": parallel})
        layout = ParallelLayout.build(cfg.parallel, cpu_runtime())
        model = layout.data_parallel.shard(_mlp(), mesh=layout.dp_mesh, runtime=cpu_runtime())
        # FSDP2's own calls, as torch.distributed's functions (torch/distributed/fsdp/_fully_shard/_fsdp_collectives)
        # and ddpkit's replacements of them on Gloo, this runtime's backend (ddpkit/parallel/gloo_collectives.py)
        for name in ("all_gather_single", "reduce_scatter_single", "all_reduce", "broadcast"):
            patch.setattr(dist, name, spy(name))
        model(torch.ones(3, 8)).sum().backward()
        weight = model[0][0].weight
        return {
            "dp": (layout.dp, layout.dp_rank),
            "placements": tuple(type(p).__name__ for p in weight.placements),
            "local_rows": weight.to_local().shape[0],
            "data_group": tuple(dist.get_process_group_ranks(layout.dp_group)),
            "joined": joined,
        }


def test_hsdp_gathers_within_a_shard_group_and_all_reduces_across_replicas(monkeypatch):
    for rank in range(4):
        hsdp = _collectives_of_one_step(HSDP, rank, monkeypatch)
        flat = _collectives_of_one_step({"mode": "fsdp2"}, rank, monkeypatch)
        # the shard group: neighbours (one node); the replicas: the same shard position in each group
        shards = (rank - rank % 2, rank - rank % 2 + 1)
        replicas = (rank % 2, rank % 2 + 2)
        # the data coordinate is plain fsdp2's over 4 (the same samples); the parameters are replicated x sharded
        assert hsdp["dp"] == flat["dp"] == (4, rank)
        assert hsdp["data_group"] == (0, 1, 2, 3)
        # the first Linear's 16 rows: half on each rank of a shard group, a quarter under fsdp2 over 4
        assert (hsdp["placements"], hsdp["local_rows"]) == (("Replicate", "Shard"), 8)
        assert (flat["placements"], flat["local_rows"]) == (("Shard",), 4)
        # 3 units with parameters (two blocks in the inner Sequential, and the last Linear: the default rule's end
        # beside them), each resharded after forward: an all-gather in the forward and again in the backward, and its
        # gradients reduce-scattered; the root holds no parameter of its own and issues none. On Gloo an all-gather is
        # one broadcast from each rank of the shard group, a reduce-scatter one all-reduce in place.
        assert sorted(hsdp["joined"]) == sorted(
            [("broadcast", shards)] * 6 * len(shards)
            + [("all_reduce", shards)] * 3
            # HSDP's one addition: each unit's gradient shard all-reduced across the replicas
            + [("all_reduce", replicas)] * 3
        ), rank
        everyone = (0, 1, 2, 3)
        flat_calls = [("broadcast", everyone)] * 6 * 4 + [("all_reduce", everyone)] * 3
        assert sorted(flat["joined"]) == sorted(flat_calls), rank


def test_estimate_counts_a_replica_s_shards():
    model = {"name": "gpt", "kwargs": {"vocab_size": 64, "dim": 32, "depth": 2, "heads": 2, "max_len": 16}}
    cfg = {"model": model, "optim": {"name": "adam"}, "parallel": HSDP}
    hsdp = estimate(cfg, nproc=4, modes=["fsdp2"]).per_mode["fsdp2"]
    on_two = estimate({**cfg, "parallel": {"mode": "fsdp2"}}, nproc=2, modes=["fsdp2"]).per_mode["fsdp2"]
    on_four = estimate({**cfg, "parallel": {"mode": "fsdp2"}}, nproc=4, modes=["fsdp2"]).per_mode["fsdp2"]
    # 2 replicas x 2 shards: each rank holds half of everything, as fsdp2 over 2 ranks does, not a quarter
    assert hsdp == on_two
    assert hsdp.parameters > on_four.parameters


class Digits(ddpkit.Trainer):
    """An MLP on digits; records what a resume loaded and each step's samples (the sum of its inputs' pixels, summed
    over the micro-batches: added over the ranks it is the global batch's, whatever the layout)."""

    def build_model(self):
        return nn.Sequential(nn.Flatten(), nn.Sequential(nn.Linear(144, 32), nn.ReLU(), nn.Linear(32, 10)))

    def on_fit_start(self):
        self.loaded = full_state(self.placed.held, self.optimizer)
        self.samples: dict[int, float] = {}

    def training_step(self, batch):
        step = self.progress.step + 1
        self.samples[step] = self.samples.get(step, 0.0) + float(batch[0].double().sum())
        return super().training_step(batch)


def _config(out: Path, *, steps: int = 6, resume: Path | None = None, **parallel) -> dict:
    """SGD with momentum, global batch 32 in 4 micro-batches on every layout, a checkpoint every 3 steps."""
    cfg = {
        "run": {"name": "hsdp", "output_dir": str(out), "seed": 0},
        "data": {"name": "digits", "global_batch_size": 32, "kwargs": {"num_train": 256, "image_size": 12}},
        "optim": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
        "train": {"max_steps": steps, "log_every": 3, "grad_accum_steps": 4},
        "parallel": parallel,
        "checkpoint": {"every_epochs": None, "every_steps": 3},
        "log": {"progress_bar": False},
    }
    if resume is not None:
        cfg["checkpoint"]["resume"] = str(resume)
    return cfg


def _fit(cfg: dict) -> dict:
    trainer = Digits(cfg)
    metrics = trainer.fit()
    state = full_state(trainer.placed.held, trainer.optimizer)
    # what this rank itself holds of each parameter (a DTensor's local shard)
    local = {k: v.to_local().clone() for k, v in trainer.placed.held.state_dict().items() if hasattr(v, "to_local")}
    return {"metrics": metrics, "state": state, "loaded": trainer.loaded, "samples": trainer.samples, "local": local}


def _relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest difference of one tensor's elements, relative to that tensor's largest."""
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-12)) for k in a)


def _global_samples(results: list[dict]) -> dict[int, float]:
    steps = results[0]["samples"]
    return {step: sum(r["samples"][step] for r in results) for step in steps}


def _assert_like(results: list[dict], reference: dict, *, after: int = 0) -> None:
    """Within 1e-6 of ``reference`` (weights and momentum, every rank), with its samples from step ``after + 1``."""
    for result in results:
        assert result["metrics"]["step"] == reference["metrics"]["step"]
        assert _relative(result["state"], reference["state"]) < 1e-6
        assert result["metrics"]["train_loss"] == pytest.approx(reference["metrics"]["train_loss"], rel=1e-6)
    expected = {step: total for step, total in reference["samples"].items() if step > after}
    assert _global_samples(results) == pytest.approx(expected, rel=1e-12)


@pytest.mark.multiprocess
def test_hsdp_2_replicas_x_2_shards_trains_like_a_world_of_one(tmp_path):
    one = run_in_pool(_fit, 1, args=(_config(tmp_path / "one"),), timeout=120)[0]
    hsdp = run_in_pool(_fit, 4, args=(_config(tmp_path / "hsdp", **HSDP),), timeout=200)
    # 4 micro-batches of 2 on each of 4 data-parallel ranks: the world of one's 4 of 8, split the same way
    _assert_like(hsdp, one)
    # ranks 0 and 2 hold the same shard in two replicas, the same bits; ranks 0 and 1 hold two halves
    local = [result["local"] for result in hsdp]
    assert local[0].keys() == local[2].keys() == {"1.0.weight", "1.0.bias", "1.2.weight", "1.2.bias"}
    assert all(torch.equal(local[0][k], local[2][k]) for k in local[0])
    assert not any(torch.equal(local[0][k], local[1][k]) for k in local[0])


def _step_3(directory: Path) -> Path:
    return directory / "checkpoints" / "step-000000003.dcp"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_hsdp_checkpoints_resume_as_fsdp2_and_a_world_of_one_and_a_ddp_one_resumes_as_hsdp(tmp_path):
    one = run_in_pool(_fit, 1, args=(_config(tmp_path / "one"),), timeout=120)[0]
    written = run_in_pool(_fit, 4, args=(_config(tmp_path / "hsdp", steps=3, **HSDP),), timeout=200)
    hsdp_at_3 = written[0]["state"]
    # HSDP on 4 -> a world of one, and -> fsdp2 on 2: the step-3 state loaded exactly, then steps 4..6
    resumed = run_in_pool(_fit, 1, args=(_config(tmp_path / "a", resume=_step_3(tmp_path / "hsdp")),), timeout=120)
    as_fsdp2 = _config(tmp_path / "b", resume=_step_3(tmp_path / "hsdp"), mode="fsdp2")
    resumed += run_in_pool(_fit, 2, args=(as_fsdp2,), timeout=200)
    for result in resumed:
        assert all(torch.equal(result["loaded"][k], v) for k, v in hsdp_at_3.items())
    _assert_like(resumed[:1], one, after=3)
    _assert_like(resumed[1:], one, after=3)
    # ddp on 2 -> HSDP on 4
    ddp_at_3 = run_in_pool(_fit, 2, args=(_config(tmp_path / "ddp", steps=3),), timeout=200)[0]["state"]
    # ddp writes one file a checkpoint; copied, so this run's own saves go beside it
    shutil.copytree(tmp_path / "ddp" / "checkpoints", tmp_path / "from-ddp" / "checkpoints")
    as_hsdp = run_in_pool(_fit, 4, args=(_config(tmp_path / "from-ddp", **HSDP),), timeout=200)
    for result in as_hsdp:
        assert all(torch.equal(result["loaded"][k], v) for k, v in ddp_at_3.items())
    _assert_like(as_hsdp, one, after=3)


class TinyLlama(ddpkit.Trainer):
    def build_datasets(self):
        return RaggedSequences(n=64), None


LLAMA = {"arch": "llama", "vocab_size": 50, "dim": 32, "depth": 2, "heads": 4, "kv_heads": 2, "mlp_dim": 64}


def _llama(out: Path, **parallel) -> dict:
    """A tiny Llama, global batch 8 in 2 micro-batches (accumulation, or a pipeline's microbatches), SGD with
    momentum, the token-weighted loss (exact for any split of the batch)."""
    train = {"max_steps": 4, "log_every": 2, "loss_normalization": "tokens"}
    if parallel.get("pipeline", 1) > 1:
        parallel["microbatches"] = 2
    else:
        train["grad_accum_steps"] = 2
    return {
        "run": {"name": "hsdp", "output_dir": str(out), "seed": 3},
        "data": {"global_batch_size": 8, "order": "index_free"},
        "model": {"name": "gpt", "kwargs": {**LLAMA, "max_len": 16, "tied": False}},
        "optim": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
        "train": train,
        "parallel": parallel,
        "checkpoint": {"every_epochs": None, "every_steps": None},
        "log": {"progress_bar": False},
    }


def _fit_llama(cfg: dict) -> dict:
    trainer = TinyLlama(cfg)
    metrics = trainer.fit()
    layout = trainer.layout
    where = (layout.pp_rank, layout.dp_rank, layout.tp_rank)
    return {"metrics": metrics, "state": full_state(trainer.placed.held, trainer.optimizer), "where": where}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_hsdp_beside_tensor_parallelism_and_inside_a_pipeline_trains_like_a_world_of_one(tmp_path):
    """On 4 ranks each composition leaves 2 data-parallel ranks: 2 replicas of one shard each (HSDP's mesh, the
    tensor plan's mesh cut from its root, the replicas' all-reduce), against a world of one."""
    one = run_in_pool(_fit_llama, 1, args=(_llama(tmp_path / "one"),), timeout=120)[0]
    tp = run_in_pool(_fit_llama, 4, args=(_llama(tmp_path / "tp", tensor=2, **HSDP),), timeout=240)
    assert [r["where"] for r in tp] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    pp = run_in_pool(_fit_llama, 4, args=(_llama(tmp_path / "pp", pipeline=2, **HSDP),), timeout=240)
    assert [r["where"] for r in pp] == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
    # 1e-5 under tensor parallelism (its split sums), 1e-6 otherwise
    for results, bound in ((tp, 1e-5), (pp, 1e-6)):
        for result in results:
            assert _relative(result["state"], one["state"]) < bound
            assert result["metrics"]["train_loss"] == pytest.approx(one["metrics"]["train_loss"], rel=bound)
