"""A ddpkit Trainer under Ray Train (a real local Ray cluster, CPU workers), and under a process group the user made.

Ray's TorchTrainer sets torchrun's variables, creates the group and runs the loop in a worker thread;
the Trainer adopts the group, installs no signal handler there, and a SIGKILLed worker costs no
completed step: the end is bitwise equal to an uninterrupted Ray run (tests/scripts/ray_job.py).
Skipped where ray is not installed (`pip install "ddpkit[ray]"`; it is in the test extra).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml
from helpers import REPO, assert_bitwise_equal, load_weights, tiny_config

JOB = REPO / "tests" / "scripts" / "ray_job.py"


def _ray_job(out: Path, kill_step: int = 0) -> subprocess.CompletedProcess:
    pytest.importorskip("ray.train.torch", reason="Ray Train is not installed (pip install 'ddpkit[ray]')")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "RAY_DEDUP_LOGS": "0"}
    # Ray Train kills the surviving workers at its next health check (every 2 s by default): on a loaded CI machine
    # the survivor's crash save can lose that race (docs/ray.md); 10 s gives it time
    env["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = "10"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "examples"), env.get("PYTHONPATH")]))  # ray_train
    args = [sys.executable, str(JOB), str(out), *([str(kill_step)] if kill_step else [])]
    done = subprocess.run(args, capture_output=True, text=True, timeout=540, env=env, cwd=REPO)
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]
    return done


def _steps(out: Path, rank: int) -> list[tuple[int, int]]:
    return [tuple(map(int, line.split())) for line in (out / f"steps-rank{rank}.txt").read_text().splitlines()]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_sigkilled_ray_worker_costs_no_step_and_the_end_is_bitwise_equal(tmp_path):
    """An engine: Ray Train starts the ranks as its own actors and restarts a killed one, which a pool of ranks
    cannot stand in for."""
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    _ray_job(whole)
    done = _ray_job(cut, kill_step=27)
    assert (cut / "killed").exists(), "rank 1 was never killed"
    log = done.stdout + done.stderr
    assert "signal only works in main thread" not in log
    assert "saved step 27 after" in log, log[-5000:]  # the surviving rank's crash save
    assert "resuming from" in log and "step-000000027.pt" in log
    for rank in (0, 1):
        steps = [step for _, step in _steps(cut, rank)]
        assert steps == list(range(1, 41)), f"rank {rank} trained {steps}"  # no step twice, none skipped
        assert len({pid for pid, _ in _steps(cut, rank)}) == 2  # two attempts: Ray restarted the group
    assert_bitwise_equal(load_weights(whole / "run" / "model.pt"), load_weights(cut / "run" / "model.pt"))
    assert "RAY RESULT" in done.stdout and "error=None" in done.stdout
    assert "checkpoint=Checkpoint(" in done.stdout  # the final checkpoint directory reached Ray's bookkeeping


# --- a process group the user created before building the Trainer -------------------------------------


def _user_group_rank(rank: int, world_size: int, store: str, config: str, results: str) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)  # no launcher: the group alone says where this process sits
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    group = dist.group.WORLD
    import ddpkit

    trainer = ddpkit.Trainer(config)
    metrics = trainer.fit()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)  # the user's group still works after fit()
    facts = {
        "initialized": dist.is_initialized(),
        "same_group": dist.group.WORLD is group,
        "sum": total.item(),
        "env": (trainer.env.rank, trainer.env.world_size, trainer.env.launcher),
        "step": metrics["step"],
    }
    Path(results, f"rank{rank}.yaml").write_text(yaml.safe_dump(facts))
    dist.destroy_process_group()


@pytest.mark.multiprocess
def test_a_users_own_process_group_is_adopted_and_not_destroyed(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(tiny_config(tmp_path, train={"epochs": 1})))
    mp.start_processes(
        _user_group_rank, args=(2, str(tmp_path / "store"), str(config), str(tmp_path)), nprocs=2, start_method="spawn"
    )
    for rank in (0, 1):
        facts = yaml.safe_load((tmp_path / f"rank{rank}.yaml").read_text())
        assert facts["initialized"] and facts["same_group"] and facts["sum"] == 3.0, facts
        assert facts["env"] == [rank, 2, "existing"] and facts["step"] > 0, facts
    assert (tmp_path / "run" / "model.pt").exists()
