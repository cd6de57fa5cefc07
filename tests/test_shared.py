"""SharedDataset: one read-only copy per host, read by every local rank and worker, never blocked by a stale segment."""

from __future__ import annotations

import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from ddpkit.data.shared import SharedDataset, remove_stale_segments
from ddpkit.distributed.env import DistEnv
from ddpkit.errors import DataError
from ddpkit.testing import run_on_ranks


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_records_arrays_and_tensors_read_back_equal(tmp_path):
    records = [{"id": f"r{i}", "tokens": np.arange(i)} for i in range(50)]
    shared = SharedDataset(records, name="records", env=DistEnv(), directory=tmp_path)
    assert len(shared) == 50 and shared[7]["id"] == "r7" and np.array_equal(shared[7]["tokens"], np.arange(7))
    shipped = pickle.loads(pickle.dumps(shared))  # what a spawned worker receives: the path, mapped again
    assert len(pickle.dumps(shared)) < 500 and shipped[49]["id"] == "r49"
    pair = SharedDataset(
        (torch.arange(20).view(10, 2), np.arange(10.0)), name="pair", env=DistEnv(), directory=tmp_path
    )
    row, label = pair[3]
    assert torch.equal(row, torch.tensor([6, 7])) and label == 3.0
    with pytest.raises(DataError, match="different lengths"):
        SharedDataset((np.zeros(3), np.zeros(4)), name="bad", env=DistEnv(), directory=tmp_path)


def test_a_new_attempt_never_meets_a_stale_segment_and_dead_writers_segments_are_removed(tmp_path):
    env = DistEnv(master_port=1234, restart_count=0)
    stale = SharedDataset([1, 2, 3], name="train", env=env, directory=tmp_path).path
    dead = _dead_pid()
    crashed = stale.with_name(stale.name.rsplit(".", 1)[0] + f".{dead}")  # as a SIGKILLed writer leaves it
    stale.rename(crashed)
    (tmp_path / f".ddpkit-shared-x.{dead}.{dead}.tmp").write_bytes(b"half")  # a killed write
    restarted = SharedDataset([4, 5], name="train", env=DistEnv(master_port=1234, restart_count=1), directory=tmp_path)
    assert list(restarted) == [4, 5] and "-a1-" in restarted.path.name
    assert not crashed.exists() and not (tmp_path / f".ddpkit-shared-x.{dead}.{dead}.tmp").exists()
    assert remove_stale_segments(tmp_path) == []  # live writers' segments stay


def _read_through_workers(tmp, calls_dir):
    import multiprocessing
    import os

    import torch.distributed as dist

    multiprocessing.set_start_method("fork", force=True)  # see test_streaming: workers forked from the rank

    def build():
        (calls_dir / f"built-by-{dist.get_rank()}").touch()
        return [{"index": i, "text": "x" * (i % 7)} for i in range(200)]

    shared = SharedDataset(build, name="train", directory=tmp)
    loader = DataLoader(shared, batch_size=10, num_workers=2, collate_fn=lambda batch: [r["index"] for r in batch])
    seen = sorted(i for batch in loader for i in batch)
    return str(shared.path), seen, os.getpid()


@pytest.mark.multiprocess
def test_two_ranks_and_their_workers_read_one_segment_which_is_gone_after_exit(tmp_path):
    """Fresh rank processes (run_on_ranks, not the pool): the segment must be gone when its writer's process exits."""
    calls = tmp_path / "calls"
    calls.mkdir()
    (tmp_path / "shm").mkdir()
    results = run_on_ranks(_read_through_workers, world_size=2, args=(tmp_path / "shm", calls), timeout=120)
    paths = {path for path, _, _ in results}
    assert len(paths) == 1 and paths.pop().endswith(f".{results[0][2]}")  # local rank 0 wrote it
    assert all(seen == list(range(200)) for _, seen, _ in results)
    assert [p.name for p in calls.iterdir()] == ["built-by-0"]  # the other rank never built the records
    assert list((tmp_path / "shm").iterdir()) == []  # removed when the writer exited
