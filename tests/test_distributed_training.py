"""Real multi-rank training on Gloo: DDP equivalence, a hand-written loop, exact evaluation, launchers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import REPO, assert_bitwise_equal, load_weights, run_cli, run_in_pool, tiny_config
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

import ddpkit
from ddpkit.data.datasets import digits
from ddpkit.models.builtin import MLP

pytestmark = pytest.mark.multiprocess


def _hand_written_ddp(cfg: dict) -> dict[str, torch.Tensor]:
    """The loop users write by hand, with the same seed, data, sampler and optimizer as the config."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(cfg["run"]["seed"])
    train, _ = digits(**cfg["data"]["kwargs"])
    model = DDP(MLP(**cfg["model"]["kwargs"]))
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg["optim"]["lr"], momentum=cfg["optim"]["momentum"])
    sampler = DistributedSampler(
        train, num_replicas=world, rank=rank, shuffle=True, seed=cfg["run"]["seed"], drop_last=True
    )
    loader = DataLoader(train, batch_size=cfg["data"]["batch_size"], sampler=sampler, drop_last=True)
    for epoch in range(cfg["train"]["epochs"]):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
    return {k: v.clone() for k, v in model.module.state_dict().items()}


def _train_twice_and_by_hand(tmp: Path) -> dict:
    cfg = tiny_config(tmp / "a")
    first = ddpkit.Trainer(cfg).fit()
    ddpkit.Trainer(tiny_config(tmp / "b")).fit()
    weights = {k: v.clone() for k, v in load_weights(tmp / "a/run/model.pt").items()}
    return {
        "metrics": first,
        "weights": weights,
        "again": load_weights(tmp / "b/run/model.pt"),
        "by_hand": _hand_written_ddp(cfg),
        "all_ranks": _gather(weights),
    }


def _gather(obj):
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def test_two_ranks_match_a_hand_written_loop_and_one_rank_with_double_batch(tmp_path):
    results = run_in_pool(_train_twice_and_by_hand, world_size=2, args=(tmp_path,), timeout=180)
    r0 = results[0]
    # ddpkit's loop is the hand-written DDP loop, bit for bit, and reproducible run to run.
    assert_bitwise_equal(r0["weights"], r0["by_hand"])
    assert_bitwise_equal(r0["weights"], r0["again"])
    # Every rank holds the same weights; metrics are reduced, hence identical on both ranks.
    assert_bitwise_equal(*r0["all_ranks"])
    assert results[0]["metrics"] == results[1]["metrics"]

    # One rank with twice the per-rank batch takes the same steps on the same samples.
    one = tiny_config(tmp_path / "one", data={"batch_size": 32})
    ddpkit.Trainer(one).fit()
    single = load_weights(tmp_path / "one/run/model.pt")
    for key, value in single.items():
        torch.testing.assert_close(r0["weights"][key], value, rtol=1e-5, atol=1e-6)


def _evaluate_untrained(tmp: Path) -> dict[str, float]:
    class Frozen(ddpkit.Trainer):
        def build_optimizer(self, model):
            return torch.optim.SGD(model.parameters(), lr=0.0)

        def validation_step(self, batch):
            metrics = super().validation_step(batch)
            return {**metrics, "label": batch[1].double()}

    cfg = tiny_config(tmp, train={"epochs": 1}, data={"val_batch_size": 8})
    return Frozen(cfg).fit()


def test_exact_evaluation_is_the_same_on_1_2_and_3_ranks(tmp_path):
    _, val = digits(**tiny_config(tmp_path)["data"]["kwargs"])
    assert len(val) == 101  # divides by neither 2 nor 3: DistributedSampler would pad
    true_label_mean = torch.stack([y for _, y in val]).double().mean().item()

    one = _evaluate_untrained(tmp_path / "w1")
    per_world = {1: one}
    for world in (2, 3):
        results = run_in_pool(_evaluate_untrained, world_size=world, args=(tmp_path / f"w{world}",), timeout=120)
        assert all(r == results[0] for r in results)
        per_world[world] = results[0]
    for world, metrics in per_world.items():
        assert metrics["val_label"] == pytest.approx(true_label_mean, abs=1e-12), world  # every sample exactly once
        assert metrics["val_accuracy"] == one["val_accuracy"], world  # counts: exact
        assert metrics["val_loss"] == pytest.approx(one["val_loss"], rel=1e-6), world  # sums in another order


def test_ddpkit_run_end_to_end_with_two_processes(tmp_path, tiny_yaml):
    """The whole `ddpkit run` path a user takes: the command line parsed, torchrun starting two workers, and the startup
    line on stderr."""
    done = run_cli("run", str(tiny_yaml), "--nproc-per-node", "2", "train.epochs=2", timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "world_size=2 backend=gloo device=cpu launcher=torchrun" in done.stderr
    assert "global batch 32" in done.stderr
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "val_accuracy" in r] == [8, 16]
    assert (run / "model.pt").exists() and (run / "config.yaml").exists()


def test_a_finished_run_reaches_interpreter_exit_with_only_its_main_thread(tmp_path, tiny_yaml):
    """Issue 28: a finished run aborted at exit when a thread took the GIL during interpreter shutdown."""
    script = str(REPO / "tests" / "scripts" / "exit_threads_trainer.py")
    done = run_cli(
        "run",
        str(tiny_yaml),
        "--nproc-per-node",
        "2",
        "--script",
        script,
        env={"EXIT_THREADS_DIR": str(tmp_path)},
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        threads = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert threads["python"] == [], threads  # the watchdog's threads were joined
        # The Gloo group was freed, its threads joined; rank 0 may still serve the store (C++ only).
        assert set(threads["os"]) <= {"pt_tcpstore_uv"}, threads


@pytest.mark.slow
def test_examples_run_under_torchrun(tmp_path):
    """The example scripts as their docstrings tell users to run them, under `torchrun --nproc-per-node=2`. In the slow
    set: it runs three torchrun jobs one after the other, and the fast set keeps
    test_ddpkit_run_end_to_end_with_two_processes, which starts the Trainer's workers through torchrun too."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    quick = subprocess.run(
        [
            *torchrun,
            "examples/train.py",
            "configs/quickstart.yaml",
            f"run.output_dir={tmp_path / 'quick'}",
            "data.kwargs.num_train=512",
            "data.kwargs.num_val=64",
            "train.epochs=1",
            "log.progress_bar=false",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert quick.returncode == 0, quick.stderr[-3000:]
    assert (tmp_path / "quick/model.pt").exists()
    custom = subprocess.run(
        [
            *torchrun,
            "examples/custom_trainer.py",
            f"run.output_dir={tmp_path / 'custom'}",
            "train.epochs=2",
            "log.progress_bar=false",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert custom.returncode == 0, custom.stderr[-3000:]
    assert "val_mse" in custom.stderr
    # The model split by hand across two devices (one device here: the same code path), in DDP.
    manual = [*torchrun, "examples/manual_placement.py", f"run.output_dir={tmp_path / 'manual'}", "train.epochs=1"]
    placed = subprocess.run(manual, cwd=REPO, capture_output=True, text=True, timeout=240, env=env)
    assert placed.returncode == 0, placed.stderr[-3000:]
    assert (tmp_path / "manual/model.pt").exists()
