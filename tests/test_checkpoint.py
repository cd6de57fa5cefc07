"""Checkpoint files: crash-safe writes, validation, discovery, pruning, safe loading, export."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from helpers import Exploit, run_cli

from ddpkit.checkpoint.files import (
    AsyncCheckpointWriter,
    find_latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    resolve_resume_path,
    save_checkpoint,
    validate_checkpoint,
)
from ddpkit.errors import CheckpointError


def state(step: int) -> dict:
    return {"model": {"w": torch.full((64, 64), float(step))}, "progress": {"step": step}, "rng": [(3, (1, 2), None)]}


def test_save_writes_data_then_manifest_and_loads_back(tmp_path):
    info = save_checkpoint(state(5), tmp_path, step=5, meta={"epoch": 1})
    assert info.path.name == "step-000000005.pt"
    manifest = json.loads((tmp_path / "step-000000005.json").read_text())
    assert manifest["bytes"] == info.path.stat().st_size and manifest["step"] == 5 and manifest["epoch"] == 1
    loaded = load_checkpoint(info.path)
    assert torch.equal(loaded["model"]["w"], state(5)["model"]["w"]) and loaded["rng"] == [(3, (1, 2), None)]
    assert not list(tmp_path.glob(".*.tmp"))


def test_keep_last_prunes_only_after_the_new_one_is_complete(tmp_path):
    for step in (1, 2, 3, 4):
        save_checkpoint(state(step), tmp_path, step=step, keep_last=2)
    assert [c.step for c in list_checkpoints(tmp_path)] == [3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-000000003.json",
        "step-000000003.pt",
        "step-000000004.json",
        "step-000000004.pt",
    ]
    save_checkpoint(state(9), tmp_path, step=9, name="best", keep_last=1)
    assert [c.step for c in list_checkpoints(tmp_path)] == [4]  # named checkpoints are never pruned
    assert validate_checkpoint(tmp_path / "best.pt").step == 9


def test_stale_temporaries_are_removed_by_the_next_save(tmp_path):
    stale = tmp_path / ".step-000000002.pt.12345.tmp"
    stale.write_bytes(b"half a checkpoint")
    save_checkpoint(state(3), tmp_path, step=3)
    assert not stale.exists()


def test_truncated_bitflipped_and_manifestless_newest_are_skipped_with_a_warning(tmp_path, caplog):
    for step in (1, 2, 3, 4):
        save_checkpoint(state(step), tmp_path, step=step)
    newest = tmp_path / "step-000000004.pt"
    newest.write_bytes(newest.read_bytes()[:-100])  # truncated
    data = bytearray((tmp_path / "step-000000003.pt").read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit, same size
    (tmp_path / "step-000000003.pt").write_bytes(bytes(data))
    (tmp_path / "step-000000002.json").unlink()  # write died before the manifest
    with caplog.at_level(logging.WARNING, logger="ddpkit"):
        latest = find_latest_checkpoint(tmp_path)
    assert latest.step == 1
    warnings = caplog.text
    assert "step-000000004.pt is truncated or altered" in warnings
    assert "step-000000003.pt is corrupt: its SHA-256 does not match" in warnings
    assert "step-000000002.pt has no manifest" in warnings


def test_explicit_resume_path_must_exist_and_be_valid(tmp_path):
    with pytest.raises(CheckpointError, match=r"checkpoint.resume=.*missing.pt: checkpoint .* does not exist"):
        resolve_resume_path(str(tmp_path / "missing.pt"), tmp_path)
    info = save_checkpoint(state(1), tmp_path, step=1)
    info.path.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="truncated or altered"):
        resolve_resume_path(str(info.path), tmp_path)
    assert resolve_resume_path("none", tmp_path) is None
    assert resolve_resume_path("auto", tmp_path / "nothing-here") is None


def test_malicious_pickle_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    info = save_checkpoint({"model": {}, "payload": Exploit(marker)}, tmp_path, step=1)
    validate_checkpoint(info.path)  # a valid file by size and checksum: the content is the problem
    with pytest.raises(
        CheckpointError, match=r"refusing to load .*could run code when loaded \(it references posix.system\)"
    ):
        load_checkpoint(info.path)
    assert not marker.exists()


def test_async_writer_writes_complete_checkpoints_and_reraises_errors(tmp_path):
    writer = AsyncCheckpointWriter()
    for step in (1, 2, 3):
        writer.stage_and_submit(state(step), tmp_path, step=step, keep_last=2)
    writer.wait()
    assert [c.step for c in list_checkpoints(tmp_path)] == [2, 3]
    validate_checkpoint(tmp_path / "step-000000003.pt")
    (tmp_path / "blocker").write_text("a file where a directory should be")
    writer.stage_and_submit(state(4), tmp_path / "blocker" / "ckpts", step=4)
    with pytest.raises(OSError):
        writer.wait()


def test_export_writes_a_plain_state_dict(tmp_path):
    save_checkpoint(state(7), tmp_path / "ckpts", step=7)
    out = tmp_path / "model.pt"
    done = run_cli("export", str(tmp_path / "ckpts"), str(out))
    assert done.returncode == 0, done.stderr
    assert "step 7" in done.stdout
    weights = torch.load(out, weights_only=True)
    assert list(weights) == ["w"] and weights["w"][0, 0] == 7.0
    missing = run_cli("export", str(tmp_path / "nope.pt"), str(out))
    assert missing.returncode == 1 and "does not exist" in missing.stderr and "Traceback" not in missing.stderr
