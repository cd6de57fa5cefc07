"""Training health under a pipeline (pp2) and tensor parallelism (tp2): a NaN names its step, rank and samples, the
spike detector reads the real loss, a spike rolls back from the sharded (DCP) checkpoints those layouts write; and the
per-stage rules of the checks that compare ranks, in one process.

    .venv/bin/pytest -q tests/test_health_layouts.py             # the fast set
    .venv/bin/pytest -q -m slow tests/test_health_layouts.py     # plus pp2 x dp2 on 4 ranks
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from helpers import REPO, load_script, run_in_pool, tiny_config
from torch.distributed.device_mesh import init_device_mesh

from ddpkit.config.health_section import StragglerConfig
from ddpkit.config.loader import load_config
from ddpkit.distributed import read_dist_env
from ddpkit.distributed.process_group import Runtime
from ddpkit.errors import HealthError
from ddpkit.parallel.data_parallel import DDP
from ddpkit.parallel.layout import ParallelLayout
from ddpkit.testing import fake_ranks
from ddpkit.training.health import _rank_checks
from ddpkit.training.straggler import StragglerWatch

pytestmark = pytest.mark.timeout(180)

SCRIPT = REPO / "tests" / "scripts" / "health_trainer.py"

#: pp2 cuts the MLP (Flatten, Linear, ReLU, Linear) before its output layer; tp2 splits both linear layers; the
#: sharded data-parallel modes write DCP checkpoints too.
LAYOUTS = {
    "pp2": {"pipeline": 2, "microbatches": 2, "split_points": ["3"]},
    "tp2": {"tensor": 2},
    "fsdp2": {"mode": "fsdp2"},
    "zero1": {"mode": "zero1"},
}

#: The sharded data-parallel modes: slow tests (pp2 and tp2 cover the rollback's DCP path in the fast set).
SHARDED_MODES = ("fsdp2", "zero1")


def _fit(tmp: Path, layout: str, fault: dict[str, str], sections: dict) -> dict:
    """One rank of a HealthTrainer run under ``layout``; a HealthError is returned, not raised."""
    import os

    health_trainer = load_script(SCRIPT)
    for name in [n for n in os.environ if n.startswith("HEALTH_")]:
        del os.environ[name]
    os.environ.update(fault)
    cls = health_trainer.PipelineHealthTrainer if layout == "pp2" else health_trainer.SequentialHealthTrainer
    trainer = cls(tiny_config(tmp, parallel=LAYOUTS[layout], **sections))
    try:
        result = {"metrics": trainer.fit(), "error": None}
    except HealthError as exc:
        result = {"metrics": None, "error": str(exc)}
    weights = trainer.placed.held.state_dict()
    result["weights"] = {k: v.full_tensor() if hasattr(v, "full_tensor") else v.clone() for k, v in weights.items()}
    result["finite"] = all(
        torch.isfinite(v.full_tensor() if hasattr(v, "full_tensor") else v).all() for v in weights.values()
    )
    return result


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["pp2", "tp2", *(pytest.param(m, marks=pytest.mark.slow) for m in SHARDED_MODES)])
def test_a_nan_and_a_loss_spike_are_named_and_rolled_back_from_sharded_checkpoints(tmp_path, layout):
    # Rank 1 holds a loss in every layout (pp2: the last stage; tp2: each rank computes it; fsdp2, zero1: a replica).
    # `add` keeps the gradients finite: only the loss tells, so the pipeline's loss function must poison them itself.
    fault = {"HEALTH_NAN_RANK": "1", "HEALTH_NAN_STEPS": "3", "HEALTH_NAN_HOW": "add", "HEALTH_SPIKE_STEPS": "13"}
    sections = {
        "log": {"progress_bar": False, "rank_files": True},
        "data": {"batch_size": 16 if layout == "tp2" else 8},  # 16 steps an epoch in every layout
        "train": {"epochs": 1, "log_every": 4},
        "health": {"spike": {"warmup": 8, "window": 16, "action": "rollback"}},
        "checkpoint": {"every_steps": 5, "keep_last": 2},
    }
    results = run_in_pool(_fit, world_size=2, args=(tmp_path, layout, fault, sections), timeout=150)
    assert [r["error"] for r in results] == [None, None] and all(r["finite"] for r in results)
    log = (tmp_path / "run" / "logs" / "rank0.log").read_text()
    # The step, the rank and the samples, as without a pipeline (before: "the loss was finite on every rank")
    assert "step 3: non-finite loss on rank(s) 1; rank 1's batch had samples [" in log, log
    # The loss itself spiked (before, under pp2, the detector saw 0 and only the norm could tell)
    spike = re.search(r"step 13: spike: loss ([\d.e+]+) \(window mean ([\d.e+]+)\)", log)
    assert spike and float(spike[1]) > 100 * float(spike[2]), log
    # Rolled back from the newest checkpoint, a DCP directory every rank read its part of
    assert re.search(r"rolled back model, optimizer.* to \S+step-0+10\.dcp", log), log
    assert "rolled back to the newest valid checkpoint" in log
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "train_loss" in r][-1]
    assert (last["nonfinite_steps"], last["spikes"], last["rollbacks"], last["skipped_steps"]) == (1, 1, 1, 2)
    assert results[0]["metrics"]["step"] == 16


@pytest.mark.slow  # 4 ranks, 24 steps: about 12 s on the loaded 2-core machine
@pytest.mark.multiprocess
def test_pp2_x_dp2_compares_each_stages_replicas_and_ranks_with_one_another(tmp_path):
    # Rank 3 is stage 1's second replica: slowed (in its loss), and its weights nudged after step 3
    fault = {"HEALTH_SLOW_RANK": "3", "HEALTH_SLOW_MS": "15", "HEALTH_PERTURB_RANK": "3", "HEALTH_PERTURB_STEP": "3"}
    sections = {
        "log": {"progress_bar": False, "rank_files": True},
        "data": {"batch_size": 8},  # 8 steps an epoch: 256 samples / (8 x 2 microbatches x 2 replicas)
        "train": {"epochs": 3, "log_every": 8},
        "health": {"check_replicas_every": 4, "straggler": {"every": 6, "windows": 2}},
    }
    results = run_in_pool(_fit, world_size=4, args=(tmp_path, "pp2", fault, sections), timeout=150)
    assert [r["error"] for r in results] == [None] * 4
    log = (tmp_path / "run" / "logs" / "rank0.log").read_text()
    assert "replica divergence at step 4: the parameters of rank(s) 3 differ from their stage's first replica's" in log
    assert "copied each stage's first replica's parameters to its other replicas" in log
    assert all(torch.equal(results[2]["weights"][k], results[3]["weights"][k]) for k in results[2]["weights"])
    # The slow replica is named against its own stage's other rank; stage 0's ranks are not compared with stage 1's
    assert "straggler: rank 3 is" in log and "slower than the median rank of its stage" in log, log
    assert not re.search(r"straggler: rank [012] ", log), log


# --- the checks that compare ranks, per stage: no process group --------------------------------------------


def _watch(world_size: int, peers: int) -> StragglerWatch:
    return StragglerWatch(
        StragglerConfig(every=2, windows=1, margin=0.25),
        parameters=[],
        rank=0,
        world_size=world_size,
        device=torch.device("cpu"),
        peers=peers,
    )


def test_a_straggler_is_compared_with_the_ranks_of_its_own_stage_only():
    # pp2 x dp2: ranks 0, 1 hold stage 0, ranks 2, 3 stage 1, which does twice the work. Rank 3 is slow for stage 1.
    times = [0.010, 0.010, 0.020, 0.030]
    assert _watch(4, peers=2)._slower(times) == {3: pytest.approx(0.5)}
    # Compared across stages, both of stage 1's ranks would be named, the balanced one too
    assert set(_watch(4, peers=4)._slower(times)) == {2, 3}


def _checks_of(world_size: int, rank: int, parallel: dict, *, ddp_over_tp: bool = False) -> tuple[int | None, ...]:
    """The straggler watch's peers and the replica check's replicas that rank ``rank`` builds (None: that check is
    off), on torch's fake backend. ``ddp_over_tp``: DDP replicas of a tp2 mesh, which ParallelLayout refuses."""
    config = load_config({"parallel": parallel, "health": {"check_replicas_every": 4}})
    with fake_ranks(world_size, rank=rank):
        runtime = Runtime(env=read_dist_env(), device=torch.device("cpu"), backend="fake")
        if ddp_over_tp:
            mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
            coordinates = dict(dp_rank=mesh.get_local_rank("dp"), tp_rank=mesh.get_local_rank("tp"))
            layout = ParallelLayout(DDP(), dp=2, pp=1, pp_rank=0, tp=2, mesh=mesh, **coordinates)
        else:
            layout = ParallelLayout.build(config.parallel, runtime)
        straggler, replicas = _rank_checks(config, runtime=runtime, model=torch.nn.Linear(2, 2), layout=layout)
        if straggler is not None:
            straggler.close()
        return (straggler.peers if straggler else None), (replicas.replicas if replicas else None)


def test_each_layout_compares_the_ranks_of_one_stage_and_a_stages_replicas_must_be_neighbours():
    # pp2 x dp2: each stage's two neighbouring ranks, for both checks, on every rank
    assert {_checks_of(4, r, {"pipeline": 2}) for r in range(4)} == {(2, 2)}
    # pp2 alone: one rank a stage, nothing to compare; tp2: both ranks do the same work, no replicas to compare
    assert _checks_of(2, 1, {"pipeline": 2}) == (None, None)
    assert _checks_of(2, 1, {"tensor": 2}) == (2, None)
    # tp2 x dp2 under fsdp2: sharded parameters, no replica check; the straggler watch compares all four
    assert _checks_of(4, 3, {"tensor": 2, "mode": "fsdp2"}) == (4, None)
    # ddp replicas two ranks apart (tp2 x dp2, which the layout refuses): the first-replica rule would compare
    # rank 1 with rank 0, another tensor rank; the check stops on its assumption instead of comparing wrong ranks
    with pytest.raises(AssertionError, match=r"rank 1's replicas are ranks \[1, 3\], not 2 neighbours from 0"):
        _checks_of(4, 1, {}, ddp_over_tp=True)
