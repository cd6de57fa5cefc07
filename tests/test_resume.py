"""Exact resume: an interrupted run ends with the same bits as an uninterrupted one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from helpers import (
    REPO,
    Exploit,
    assert_bitwise_equal,
    load_weights,
    merge_sections,
    run_cli,
    run_in_pool,
    tiny_cnn_config,
    tiny_config,
)

import ddpkit
from ddpkit.checkpoint.files import list_checkpoints, save_checkpoint
from ddpkit.errors import CheckpointError

pytestmark = pytest.mark.multiprocess


def cnn_config(out: Path, **sections) -> dict:
    """The MNIST CNN (it has dropout, so resume must restore every RNG) on 16x16 digits, 8 steps per epoch
    on 2 ranks."""
    cfg = tiny_cnn_config(out, train={"epochs": 3, "log_every": 5}, checkpoint={"every_steps": 1, "keep_last": 3})
    return merge_sections(cfg, sections)


class _Interrupted(Exception):
    pass


class StopAfter(ddpkit.Trainer):
    """Dies right after optimizer step ``stop_after + 1`` finishes, i.e. after checkpoint ``stop_after`` is on disk."""

    stop_after = -1

    def on_step_end(self, step):
        if step == self.stop_after + 1:
            raise _Interrupted


def _interrupt_and_resume(tmp: Path, variants: list[tuple[str, dict, list[int]]]) -> dict:
    out = {}
    for name, sections, stops in variants:
        ddpkit.Trainer(cnn_config(tmp / name / "full", **sections)).fit()
        out[name, "full"] = load_weights(tmp / name / "full/run/model.pt")
        for k in stops:
            cfg = cnn_config(tmp / name / f"k{k}", **sections)
            trainer = StopAfter(cfg)
            trainer.stop_after = k
            with pytest.raises(_Interrupted):
                trainer.fit()
            resumed = ddpkit.Trainer(cfg)
            metrics = resumed.fit()
            out[name, k] = load_weights(tmp / name / f"k{k}/run/model.pt")
            out[name, k, "metrics"] = metrics
    return out


def test_stop_after_any_step_and_resume_gives_bitwise_identical_weights(tmp_path):
    variants = [
        # 8 steps per epoch: mid-epoch, the last step of an epoch, mid-epoch in the second epoch.
        ("plain", {}, [3, 8, 13]),
        # Accumulation, a warmup + cosine schedule and clipping must resume exactly too.
        (
            "accum",
            {
                "train": {"epochs": 2, "grad_accum_steps": 2, "clip_grad_norm": 1.0},
                "sched": {"name": "cosine", "warmup_steps": 2},
            },
            [3],
        ),
    ]
    results = run_in_pool(_interrupt_and_resume, world_size=2, args=(tmp_path, variants), timeout=300)
    for name, _, stops in variants:
        for k in stops:
            assert_bitwise_equal(results[0][name, k], results[0][name, "full"])
            assert results[0][name, k, "metrics"]["step"] == results[1][name, k, "metrics"]["step"]


def _crash_script(cfg_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "tests/checkpoint_crash.py", str(cfg_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
    )


@pytest.mark.parametrize("point", ["mid-file", "before-rename", "before-manifest"])
def test_killed_during_a_checkpoint_write_resumes_from_the_last_complete_one(tmp_path, point, capfd):
    """A process SIGKILLed inside a checkpoint write; the resume, in this process, finds the last complete one."""
    cfg = cnn_config(
        tmp_path, train={"epochs": 1}, data={"batch_size": 32}, checkpoint={"every_steps": 2, "keep_last": 5}
    )
    cfg_path = tmp_path / "exp.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    ckpt_dir = tmp_path / "run" / "checkpoints"

    crashed = _crash_script(cfg_path, {"CRASH_AT_SAVE": "3", "CRASH_POINT": point})
    assert crashed.returncode == -9, crashed.stderr[-2000:]
    assert [c.step for c in list_checkpoints(ckpt_dir)] == [2, 4]  # the third save (step 6) never became valid

    # The resume needs no second interpreter: the same config, trained here, its log read from this process's stderr.
    capfd.readouterr()
    ddpkit.Trainer(cfg).fit()
    resumed = capfd.readouterr().err
    assert "resuming from" in resumed and "step-000000004.pt (step 4)" in resumed
    if point == "before-manifest":
        assert "skipping checkpoint" in resumed and "has no manifest" in resumed
    assert not list(ckpt_dir.glob(".*.tmp"))  # the killed write's temporary file was cleaned up

    reference = cnn_config(
        tmp_path / "ref", train={"epochs": 1}, data={"batch_size": 32}, checkpoint={"every_steps": 2, "keep_last": 5}
    )
    ddpkit.Trainer(reference).fit()
    assert_bitwise_equal(load_weights(tmp_path / "run/model.pt"), load_weights(tmp_path / "ref/run/model.pt"))


def test_torchrun_restarts_a_killed_worker_and_ends_bitwise_equal(tmp_path):
    """`ddpkit run`'s own restart (`--max-restarts 2`) after rank 1 SIGKILLs itself, resuming from the newest periodic
    checkpoint."""

    def launch(out: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
        cfg_path = out / "exp.yaml"
        out.mkdir()
        # crash_save off: this test is about the newest periodic checkpoint (tests/test_goodput.py has the crash save)
        cfg_path.write_text(
            yaml.safe_dump(cnn_config(out, train={"epochs": 2}, checkpoint={"every_steps": 3, "crash_save": False}))
        )
        return run_cli(
            "run",
            str(cfg_path),
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "2",
            "--script",
            "tests/checkpoint_crash.py",
            env=env,
            timeout=180,
        )

    killed = launch(tmp_path / "killed", {"KILL_RANK": "1", "KILL_AT_STEP": "7"})
    assert killed.returncode == 0, killed.stderr[-3000:]
    # the restart picked up the newest checkpoint
    assert "resuming from" in killed.stderr and "(step 6)" in killed.stderr
    clean = launch(tmp_path / "clean", {})
    assert clean.returncode == 0, clean.stderr[-3000:]
    assert "resuming from" not in clean.stderr
    assert_bitwise_equal(load_weights(tmp_path / "killed/run/model.pt"), load_weights(tmp_path / "clean/run/model.pt"))


def test_resume_with_a_math_changing_config_is_refused_with_the_differences(tmp_path):
    ddpkit.Trainer(tiny_config(tmp_path, train={"epochs": 1}, checkpoint={"every_epochs": 1})).fit()
    changed = tiny_config(
        tmp_path, train={"epochs": 2}, optim={"lr": 0.2}, data={"batch_size": 8}, checkpoint={"every_epochs": 1}
    )
    with pytest.raises(CheckpointError) as err:
        ddpkit.Trainer(changed).fit()
    message = str(err.value)
    assert "optim.lr: 0.1 -> 0.2" in message and "data.batch_size: 16 -> 8" in message
    assert "train.epochs" not in message  # training longer is a harmless change
    assert "checkpoint.allow_config_change=true" in message and "checkpoint.resume=none" in message
    # Harmless changes resume; an explicit override resumes anyway.
    assert (
        ddpkit.Trainer(
            tiny_config(tmp_path, train={"epochs": 2, "log_every": 1}, checkpoint={"every_epochs": 1})
        ).fit()["step"]
        == 32
    )
    override = tiny_config(
        tmp_path, train={"epochs": 3}, optim={"lr": 0.2}, checkpoint={"every_epochs": 1, "allow_config_change": True}
    )
    assert ddpkit.Trainer(override).fit()["step"] == 48


def test_async_checkpoints_are_complete_and_training_is_unchanged(tmp_path):
    sync = tiny_config(tmp_path / "sync", checkpoint={"every_steps": 3})
    async_ = tiny_config(tmp_path / "async", checkpoint={"every_steps": 3, "async": True})
    ddpkit.Trainer(sync).fit()
    ddpkit.Trainer(async_).fit()
    assert_bitwise_equal(load_weights(tmp_path / "sync/run/model.pt"), load_weights(tmp_path / "async/run/model.pt"))
    steps = [c.step for c in list_checkpoints(tmp_path / "async/run/checkpoints")]
    assert steps == [30, 32]  # keep_last=2, and the final state is saved at the end
    sync_state = torch.load(tmp_path / "sync/run/checkpoints/step-000000030.pt", weights_only=True)
    async_state = torch.load(tmp_path / "async/run/checkpoints/step-000000030.pt", weights_only=True)
    assert_bitwise_equal(sync_state["model"], async_state["model"])


def test_a_malicious_newest_checkpoint_stops_the_resume_and_runs_nothing(tmp_path, tiny_cfg):
    marker = tmp_path / "pwned"
    save_checkpoint({"model": {}, "payload": Exploit(marker)}, tmp_path / "run/checkpoints", step=99)
    with pytest.raises(CheckpointError, match="refusing to load .*step-000000099.pt"):
        ddpkit.Trainer(tiny_cfg).fit()
    assert not marker.exists()
