"""A failed checkpoint write (a full disk) ends with one line naming the checkpoint, the directory,
the space needed and free, and the newest complete checkpoint; nothing half-written is left, and
every earlier checkpoint stays valid. Discovery skips foreign and truncated files with a warning.

    pytest -q tests/test_disk_full.py

The full disk is simulated here (``ENOSPC`` from the file's ``write``, and torch's zip writer's own
``RuntimeError``). The real scenario, on a 2 MiB tmpfs (root): ``mount -t tmpfs -o size=2m tmpfs DIR``,
``ddpkit run`` with ``run.output_dir=DIR/run`` and a checkpoint every few steps until the save fails;
then ``mount -o remount,size=8m DIR`` and the same command resumes (docs/troubleshooting.md).
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest
import torch

from ddpkit.checkpoint import disk_space
from ddpkit.checkpoint.files import find_latest_checkpoint, list_checkpoints, save_checkpoint, validate_checkpoint
from ddpkit.errors import CheckpointError


def state(step: int) -> dict:
    return {"model": {"w": torch.full((64, 64), float(step))}, "step": step}


class _FullDisk:
    """Wraps the file object torch.save writes to: after ``budget`` bytes every write fails with ENOSPC."""

    def __init__(self, budget: int):
        self.budget = budget

    def __call__(self, real_open):
        def fake_open(path, mode="r", *args, **kwargs):
            f = real_open(path, mode, *args, **kwargs)
            if "w" not in mode or not Path(path).name.startswith("."):
                return f
            budget, write = [self.budget], f.write

            def limited(data):
                if len(data) > budget[0]:
                    raise OSError(errno.ENOSPC, "No space left on device")
                budget[0] -= len(data)
                return write(data)

            f.write = limited
            return f

        return fake_open


@pytest.mark.parametrize("budget", [0, 5000])
def test_a_full_disk_names_the_checkpoint_the_space_and_the_newest_one(
    tmp_path: Path, monkeypatch, budget: int
) -> None:
    import builtins

    save_checkpoint(state(1), tmp_path, step=1)
    save_checkpoint(state(2), tmp_path, step=2)
    monkeypatch.setattr(builtins, "open", _FullDisk(budget)(builtins.open))
    with pytest.raises(CheckpointError) as err:
        save_checkpoint(state(3), tmp_path, step=3)
    message = str(err.value)
    assert "\n" not in message
    assert f"could not write checkpoint step-000000003.pt in {tmp_path}: " in message
    assert "it needs about 16.0 KiB" in message and "free)" in message
    assert (
        "the newest complete checkpoint is step-000000002.pt" in message and "run the same command to resume" in message
    )
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"step-00000000{s}.{x}" for s in (1, 2) for x in ("json", "pt")
    ]
    assert [validate_checkpoint(p).step for p in sorted(tmp_path.glob("*.pt"))] == [1, 2]


def test_torchs_own_zip_error_on_a_full_disk_counts_as_no_space(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(disk_space, "free_bytes", lambda directory: 1000)

    def failing_save(obj, f, *args, **kwargs):
        f.write(b"x" * 100)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 171776 vs 171704")

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(
        CheckpointError, match=r"no space left on device \(it needs about 16.0 KiB, 1000 B free\); there is no earlier"
    ):
        save_checkpoint(state(1), tmp_path, step=1)
    assert list(tmp_path.iterdir()) == []


def test_a_save_that_will_not_fit_is_warned_about_first(tmp_path: Path, monkeypatch, caplog) -> None:
    monkeypatch.setattr(disk_space, "free_bytes", lambda directory: 2048)
    monkeypatch.setattr(disk_space, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="ddpkit"):
        save_checkpoint(state(1), tmp_path, step=1)  # the disk is not really full: the save succeeds
    assert "checkpoint step-000000001.pt needs about 16.0 KiB, but only 2.0 KiB is free" in caplog.text


def test_a_failed_manifest_write_removes_the_data_file_too(tmp_path: Path, monkeypatch) -> None:
    import ddpkit.checkpoint.files as files

    real = files.write_atomically

    def manifest_fails(path, data, **kwargs):
        if str(path).endswith(".json"):
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        return real(path, data, **kwargs)

    monkeypatch.setattr(files, "write_atomically", manifest_fails)
    with pytest.raises(CheckpointError, match="no space left on device"):
        save_checkpoint(state(1), tmp_path, step=1)
    assert list(tmp_path.iterdir()) == []


def test_foreign_truncated_and_odd_files_in_checkpoints_are_skipped_with_a_warning(tmp_path: Path, caplog) -> None:
    for step in (1, 2):
        save_checkpoint(state(step), tmp_path, step=step)
    (tmp_path / "step-000000009.pt").write_bytes(b"not a checkpoint")  # foreign: no manifest
    (tmp_path / "step-000000008.pt").mkdir()  # a directory under a checkpoint's name
    (tmp_path / "step-000000008.json").write_text('{"bytes": 1, "sha256": "x", "step": 8}')
    (tmp_path / "step-000000007.pt").write_bytes(b"x")
    (tmp_path / "step-000000007.json").write_text('{"bytes": 1, "sha256": "x", "step": "seven"}')  # a foreign manifest
    (tmp_path / "step-000000006.pt").write_bytes(b"x")
    (tmp_path / "step-000000006.json").write_text('{"bytes": 1, "sha')  # a truncated manifest
    (tmp_path / "notes.txt").write_text("mine")
    with caplog.at_level(logging.WARNING, logger="ddpkit"):
        latest = find_latest_checkpoint(tmp_path)
    assert latest is not None and latest.step == 2
    for name in (
        "step-000000009.pt has no manifest",
        "step-000000008.pt holds no complete checkpoint",
        "step-000000007.json is not a ddpkit manifest",
        "step-000000006.json is unreadable",
    ):
        assert name in caplog.text
    assert [info.step for info in list_checkpoints(tmp_path)] == [1, 2]


def test_a_failed_sharded_save_removes_its_partial_directory(tmp_path: Path, monkeypatch) -> None:
    from ddpkit.checkpoint import sharded

    class FailingDcp:
        def save(self, tensors, checkpoint_id):
            os.makedirs(checkpoint_id)
            (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"half")
            raise RuntimeError(
                "CheckpointException ranks:dict_keys([0])\nTraceback ... OSError: [Errno 28] No space left on device"
            )

    monkeypatch.setattr(sharded, "_dcp", lambda: FailingDcp())
    with pytest.raises(
        CheckpointError, match=r"could not write checkpoint step-000000005.dcp in .*: no space left on device"
    ):
        sharded.save_sharded({"model": {"w": torch.zeros(4)}}, {"step": 5}, tmp_path, step=5, rank=0)
    assert list(tmp_path.iterdir()) == []
