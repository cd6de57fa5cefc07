"""Bitwise resume on 3 and 4 ranks, end to end: a SIGKILL resumed from a periodic checkpoint, the crash save and
memory snapshots (ddp), periodic sharded checkpoints (zero1, fsdp2), with accumulation on 4 ranks.

    .venv/bin/pytest -q tests/test_resume_many_ranks.py

Why 3 ranks and more: on 2 ranks ``a + b == b + a``, so a reduction that adds in another order after a resume
(DDP's first-iteration bucket layout, ddpkit.distributed.bucket_layout) still gives the same bits. The oracle is
the one of tests/test_goodput.py: each rank's batches before and after the kill join up exactly with an
uninterrupted run's, and the final weights are bitwise equal.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from helpers import assert_bitwise_equal, load_weights, run_cli, tiny_cnn_config

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(900)]

SCRIPT = "tests/scripts/goodput_trainer.py"


def _run(out: Path, *, nproc: int, env: dict[str, str], **sections) -> str:
    """Train 2 epochs of the digits CNN (dropout: every rank's RNG stream must come back) on ``nproc`` ranks."""
    out.mkdir(parents=True)
    data = {"batch_size": 8, "kwargs": {"num_train": 96 * nproc, "num_val": 40, "image_size": 16}}
    checkpoint = {"every_epochs": None, "memory_every_steps": None, **sections.pop("checkpoint", {})}
    cfg = tiny_cnn_config(out, data=data, checkpoint=checkpoint, **sections)
    (out / "exp.yaml").write_text(yaml.safe_dump(cfg))
    args = ["run", str(out / "exp.yaml"), "--nproc-per-node", str(nproc), "--max-restarts", "1", "--script", SCRIPT]
    done = run_cli(*args, env=env, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


def _trained(out: Path, rank: int) -> list[tuple[int, int, str]]:
    lines = (out / "run" / f"trained-rank{rank}.log").read_text().splitlines()
    return [(int(attempt), int(step), fingerprint) for attempt, step, fingerprint in map(str.split, lines)]


def _check_join_up(out: Path, clean: Path, *, nproc: int, resumed_at: int) -> None:
    """Steps after ``resumed_at`` trained once more and nothing before, on the batches and to the weights of
    the uninterrupted run."""
    for rank in range(nproc):
        trained = _trained(out, rank)
        first = [(step, fp) for attempt, step, fp in trained if attempt == 0 and step <= resumed_at]
        again = [(step, fp) for attempt, step, fp in trained if attempt == 1]
        assert again[0][0] == resumed_at + 1, trained
        assert first + again == [(step, fp) for _, step, fp in _trained(clean, rank)]
    assert_bitwise_equal(load_weights(out / "run/model.pt"), load_weights(clean / "run/model.pt"))


def test_three_ranks_resume_bitwise_from_a_periodic_checkpoint_the_crash_save_and_memory(tmp_path):
    """`ddpkit run`'s own restart (`--max-restarts 1`) after one rank, or every rank, SIGKILLs itself."""
    clean = tmp_path / "clean"
    _run(clean, nproc=3, env={}, checkpoint={"every_steps": 5})

    periodic = tmp_path / "periodic"
    kill = {"KILL_RANKS": "1", "KILL_AT_STEP": "8"}
    stderr = _run(periodic, nproc=3, env=kill, checkpoint={"every_steps": 5, "crash_save": False})
    assert "step-000000005" in stderr, stderr[-3000:]
    _check_join_up(periodic, clean, nproc=3, resumed_at=5)

    crash = tmp_path / "crash"
    stderr = _run(crash, nproc=3, env={"KILL_RANKS": "2", "KILL_AT_STEP": "7"}, checkpoint={"every_steps": 5})
    assert "saved step 7 after" in stderr, stderr[-3000:]
    _check_join_up(crash, clean, nproc=3, resumed_at=7)

    memory = tmp_path / "memory"
    lost_host = {"KILL_RANKS": "all", "KILL_AT_STEP": "10"}
    stderr = _run(memory, nproc=3, env=lost_host, checkpoint={"every_steps": 5, "memory_every_steps": 3})
    # The snapshot of step 9 is written off the training thread: on a loaded machine the kill at step 10 may
    # come before it is complete, and the restart then takes the newest complete one (step 6, or disk's 5).
    resumed = re.search(r"resuming from (\S+) \(step (\d+)\)", stderr)
    assert resumed is not None and int(resumed.group(2)) in (5, 6, 9), stderr[-3000:]
    if int(resumed.group(2)) != 5:
        assert resumed.group(1).startswith("/dev/shm/"), stderr[-3000:]
    _check_join_up(memory, clean, nproc=3, resumed_at=int(resumed.group(2)))


@pytest.mark.parametrize("mode", ["zero1", "fsdp2"])
def test_three_ranks_resume_bitwise_in_the_sharded_modes(tmp_path, mode):
    """`ddpkit run`'s own restart (`--max-restarts 1`) after rank 1 SIGKILLs itself, resuming a sharded run."""
    # No crash save here (a survivor cannot hold the dead rank's shards: docs/modes.md): the periodic DCP checkpoint.
    parallel = {"mode": mode}
    checkpoint = {"every_steps": 5}
    _run(tmp_path / "clean", nproc=3, env={}, parallel=parallel, checkpoint=checkpoint)
    kill = {"KILL_RANKS": "1", "KILL_AT_STEP": "7"}
    _run(tmp_path / "killed", nproc=3, env=kill, parallel=parallel, checkpoint=checkpoint)
    _check_join_up(tmp_path / "killed", tmp_path / "clean", nproc=3, resumed_at=5)


def test_four_ranks_with_accumulation_resume_bitwise_from_the_crash_save(tmp_path):
    """`ddpkit run`'s own restart (`--max-restarts 1`) after rank 3 SIGKILLs itself, from the survivors' crash save."""
    train = {"epochs": 2, "grad_accum_steps": 2}
    _run(tmp_path / "clean", nproc=4, env={}, train=train)
    kill = {"KILL_RANKS": "3", "KILL_AT_STEP": "5"}
    stderr = _run(tmp_path / "crash", nproc=4, env=kill, train=train)
    assert "saved step 5 after" in stderr, stderr[-3000:]
    _check_join_up(tmp_path / "crash", tmp_path / "clean", nproc=4, resumed_at=5)
