"""A layout whose largest rank cannot hold its parameters, gradients and optimizer state is refused before the model
is made (issue 67): by the Trainer on every rank, and by ``ddpkit run`` before it starts a worker.

    .venv/bin/pytest -q tests/test_fit_check.py

The refused model is a GPT of dim 16,384 and 64 blocks (206 billion parameters: 3.0 TiB with gradients and
Adam's state), built on the meta device, so the refusal costs seconds and no memory.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import yaml
from helpers import RaggedSequences, run_cli, run_in_pool

import ddpkit
from ddpkit.config.loader import load_config
from ddpkit.errors import ConfigError
from ddpkit.models.gpt import gpt
from ddpkit.training.footprint import fit_problem, footprint

pytestmark = pytest.mark.timeout(300)

HUGE = {"vocab_size": 50, "dim": 16384, "depth": 64, "heads": 128, "max_len": 16}
TINY = {"vocab_size": 50, "dim": 32, "depth": 2, "heads": 2, "max_len": 16}
GiB = 2**30


def _config(out: Path | str, model: dict, mode: str = "fsdp2") -> dict:
    return {
        "run": {"name": "fit", "output_dir": str(out), "seed": 0},
        "data": {"global_batch_size": 4, "order": "index_free"},
        "model": {"name": "gpt", "kwargs": model},
        "optim": {"name": "adam", "lr": 1e-3},
        "train": {"max_steps": 1},
        "parallel": {"mode": mode},
        "checkpoint": {"every_epochs": None},
        "log": {"progress_bar": False},
    }


def _meta(model: dict) -> torch.nn.Module:
    with torch.device("meta"):
        return gpt(**model)


def test_the_rule_counts_what_each_mode_s_largest_rank_holds_and_names_what_would_fit():
    cfg = load_config(_config("unused", TINY))
    model = _meta(TINY)
    n = sum(p.numel() for p in model.parameters())
    held = footprint(model, cfg, nproc=2)
    # Adam: parameters, gradients and two state tensors, fp32; ddp holds all of it, fsdp2 about half (dim-0 chunks)
    assert held.per_mode["ddp"].total == 4 * 4 * n
    assert held.per_mode["zero1"].parameters == 4 * n and held.per_mode["zero1"].optimizer < 2 * 4 * n
    assert 2 * held.per_mode["fsdp2"].total == pytest.approx(4 * 4 * n, rel=0.01)
    assert fit_problem(held, "ddp", 4 * 4 * n, nproc=2) is None
    # between fsdp2's share and ddp's: ddp is refused, naming the modes that fit on the same ranks
    problem = fit_problem(held, "ddp", 4 * 4 * n - 1, nproc=2)
    assert problem.startswith(
        f"parallel.mode=ddp on 2 rank(s) cannot fit: its largest rank would hold {16 * n / 2**10:.2f} KiB"
    )
    assert "parallel.mode=zero1" in problem and "parallel.mode=fsdp2" in problem
    # a frozen parameter (LoRA's base) is held, without a gradient or optimizer state
    model.requires_grad_(False)
    model.head.requires_grad_(True)
    frozen = footprint(model, cfg, nproc=2).per_mode["ddp"]
    assert frozen.parameters == 4 * n and frozen.gradients == frozen.optimizer // 2 == 4 * model.head.weight.numel()


def test_a_model_no_mode_can_hold_names_the_ranks_fsdp2_would_need():
    cfg = load_config(_config("unused", HUGE))
    held = footprint(_meta(HUGE), cfg, nproc=2)
    need = held.per_mode["fsdp2"].total
    assert need > 1.4 * 2**40
    problem = fit_problem(held, "fsdp2", 30 * GiB, nproc=2)
    assert f"would hold {need / GiB:.2f} GiB" in problem and "the device has 30.00 GiB a rank" in problem
    # 3.0 TiB over ranks of 30 GiB: 128 is the first power of two (24 GiB a rank)
    assert "none of ddp, zero1, fsdp2 fits on these ranks; parallel.mode=fsdp2 fits from 128 ranks" in problem


class Sequences(ddpkit.Trainer):
    def build_datasets(self):
        return RaggedSequences(n=8), None


def _refused_then_fits(out: str) -> dict:
    began = time.perf_counter()
    try:
        Sequences(_config(Path(out) / "huge", HUGE)).fit()
        refused = None
    except ConfigError as error:
        refused = str(error)
    seconds = time.perf_counter() - began
    tiny = Sequences(_config(Path(out) / "tiny", TINY))
    tiny.fit()
    return {"refused": refused, "seconds": seconds, "steps": tiny.progress.step}


def test_every_rank_refuses_a_layout_that_cannot_fit_before_making_the_model_and_trains_one_that_can(tmp_path):
    ranks = run_in_pool(_refused_then_fits, 2, args=(str(tmp_path),), timeout=200)
    for rank, result in enumerate(ranks):
        assert result["refused"] is not None, rank
        assert result["refused"].startswith("parallel.mode=fsdp2 on 2 rank(s) cannot fit: its largest rank would"), rank
        assert "parallel.mode=fsdp2 fits from" in result["refused"], rank
        # built on meta and refused: no 3 TiB was made (a real build would not end at all)
        assert result["seconds"] < 60, rank
        assert result["steps"] == 1, rank
    # one agreed verdict: the same message on both ranks
    assert ranks[0]["refused"] == ranks[1]["refused"]


def test_train_memory_check_false_lets_the_layout_start(tmp_path):
    """The check is an estimate against what the device has now: a user who knows better (memory another job will
    free, swap) turns it off, and the same layout is not refused."""
    from ddpkit.training.footprint import refuse_before_spawning

    checked = load_config(_config(tmp_path, HUGE))
    with pytest.raises(ConfigError, match=r"cannot fit: .*; train.memory_check=false starts it anyway"):
        refuse_before_spawning(checked, world_size=2, local_world_size=2, device=torch.device("cpu"))
    unchecked = load_config({**_config(tmp_path, HUGE), "train": {"max_steps": 1, "memory_check": False}})
    refuse_before_spawning(unchecked, world_size=2, local_world_size=2, device=torch.device("cpu"))


def test_ddpkit_run_refuses_it_before_starting_a_worker(tmp_path):
    path = tmp_path / "huge.yaml"
    path.write_text(yaml.safe_dump({**_config(tmp_path / "out", HUGE), "data": {"name": "digits"}}))
    done = run_cli("run", str(path), "--nproc-per-node", "2", timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "parallel.mode=fsdp2 on 2 rank(s) cannot fit" in done.stderr
    # no worker ran: none wrote its run directory
    assert not (tmp_path / "out").exists()
