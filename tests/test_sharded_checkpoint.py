"""Sharded DCP checkpoints: written by every rank, committed by rename, resharded across modes and world sizes.

.venv/bin/pytest tests/test_sharded_checkpoint.py -q
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import built_in_mode, full_state, run_cli, run_in_pool, train_and_save_sharded
from tiny_lm import TinyLM

from ddpkit.checkpoint import files
from ddpkit.checkpoint.sharded import ShardedParts, load_sharded

pytestmark = pytest.mark.timeout(300)


def _load(tmp: str, mode: str) -> tuple[dict[str, torch.Tensor], float, dict]:
    model, optimizer, _, _ = built_in_mode(mode)
    info = files.find_latest_checkpoint(tmp)
    rest = load_sharded(info.path, ShardedParts(model, optimizer))
    return full_state(model, optimizer), optimizer.param_groups[0]["lr"], rest["progress"]


@pytest.mark.slow
def test_fsdp2_checkpoint_resumes_in_every_mode_and_world_size(tmp_path):
    saved = run_in_pool(train_and_save_sharded, 2, args=(str(tmp_path), "fsdp2"), timeout=120)[0]
    info = files.find_latest_checkpoint(tmp_path)
    assert info.path.name == "step-000000003.dcp" and info.manifest["format"] == "dcp"
    # each rank wrote its shard
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "state.pt"} <= set(info.manifest["files"])
    for mode, world in [("ddp", 1), ("zero1", 2), ("fsdp2", 3)]:
        loaded, lr, progress = run_in_pool(_load, world, args=(str(tmp_path), mode), timeout=120)[0]
        assert loaded.keys() == saved.keys(), (mode, world)
        for key in saved:
            assert torch.equal(loaded[key], saved[key]), f"{mode} on {world}: {key} differs"
        assert lr == 0.005 and progress == {"step": 3}


@pytest.mark.slow
def test_zero1_checkpoint_holds_every_rank_partition_and_loads_into_fsdp2(tmp_path):
    saved = run_in_pool(train_and_save_sharded, 2, args=(str(tmp_path), "zero1"), timeout=120)[0]
    assert any(".exp_avg" in key for key in saved) and any(".exp_avg_sq" in key for key in saved)
    loaded, _, _ = run_in_pool(_load, 2, args=(str(tmp_path), "fsdp2"), timeout=120)[0]
    assert loaded.keys() == saved.keys()
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)


@pytest.mark.slow  # 20-50 s on the shared machine: a 2-rank spawn and a CLI process
def test_export_joins_the_shards_and_incomplete_saves_are_skipped(tmp_path):
    """``ddpkit export`` of a DCP directory; the crash windows on disk: DCP written but not renamed,
    renamed but no manifest."""
    saved = run_in_pool(train_and_save_sharded, 2, args=(str(tmp_path), "fsdp2"), timeout=120)[0]
    good = files.find_latest_checkpoint(tmp_path)
    result = run_cli("export", str(tmp_path), str(tmp_path / "model.pt"), timeout=60)
    assert result.returncode == 0 and "DCP directory" in result.stdout and good.path.name in result.stdout, (
        result.stderr
    )
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    assert exported.keys() == {k.removeprefix("model.") for k in saved if k.startswith("model.")}
    assert all(torch.equal(exported[k], saved[f"model.{k}"]) for k in exported)
    # loads into the bare network
    assert TinyLM(vocab=16, dim=12, depth=2, heads=2, max_len=8).load_state_dict(exported)
    cut = tmp_path / "step-000000009.dcp"  # renamed, manifest never written
    cut.mkdir()
    (cut / ".metadata").write_bytes(b"x")
    (tmp_path / ".step-000000010.dcp.partial").mkdir()  # killed during DCP's write
    assert files.find_latest_checkpoint(tmp_path).path == good.path
    manifest = json.loads(files.manifest_path(good.path).read_text())
    (good.path / "__1_0.distcp").write_bytes(b"truncated")
    with pytest.raises(Exception, match="incomplete or altered"):
        files.validate_checkpoint(good.path)
    assert manifest["files"]["__1_0.distcp"] > len(b"truncated")


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_one_process_fsdp2_run_saves_dcp_directories_that_export_and_resume_as_zero1(tmp_path, async_save):
    """The fast in-process case: a world of one through the Trainer, both directions of the format
    (DCP's async_save too)."""
    from helpers import tiny_config

    from ddpkit import Trainer
    from ddpkit.checkpoint.sharded import export_model

    def cfg(mode, steps):
        return tiny_config(
            tmp_path,
            parallel={"mode": mode},
            train={"epochs": None, "max_steps": steps, "log_every": 100},
            optim={"name": "adam", "lr": 0.003, "momentum": 0.0},
            checkpoint={"every_steps": 3, "async": async_save},
        )

    Trainer(cfg("fsdp2", 6)).fit()
    info = files.find_latest_checkpoint(tmp_path / "run/checkpoints")
    assert info.path.name == "step-000000006.dcp" and [c.step for c in files.list_checkpoints(info.path.parent)] == [
        3,
        6,
    ]
    exported, final = export_model(info.path), torch.load(tmp_path / "run/model.pt", weights_only=True)
    assert exported.keys() == final.keys() and all(torch.equal(exported[k], final[k]) for k in final)
    assert Trainer(cfg("zero1", 9)).fit()["step"] == 9  # resumed at 6 in another mode, saved a DCP directory of step 9
    assert files.find_latest_checkpoint(tmp_path / "run/checkpoints").path.name == "step-000000009.dcp"
