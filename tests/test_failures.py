"""One rank fails or disagrees: every rank stops quickly, says why, and nothing is left running.

The launcher tests start real jobs through the real launcher,

    python -m ddpkit run CONFIG --nproc-per-node 2 --script tests/scripts/fault_trainer.py

with a fault injected on one rank at a chosen point (see that script), and check: the job exits
non-zero; the time from the fault (the script writes a timestamp right before raising) to the
exit of the last process stays under ``dist.failure_timeout`` (the process-group timeout is set
far higher, so a job that only stops when a collective times out fails the test); the failing
rank's exception is in the launcher's output and named as the root cause; and no process whose
command line contains the test's temporary directory survives.

The startup-consistency, data and debug-mode tests run 2 Gloo ranks in-process with
``ddpkit.testing.run_on_ranks``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from helpers import REPO, processes_mentioning, run_in_pool, tiny_config
from torch.utils.data import Sampler

import ddpkit
from ddpkit import ConsistencyError, DataError
from ddpkit.distributed.collectives import barrier
from ddpkit.testing import RankFailure

pytestmark = pytest.mark.multiprocess

FAULT_SCRIPT = REPO / "tests" / "scripts" / "fault_trainer.py"
FAILURE_TIMEOUT = 15.0  # dist.failure_timeout of these jobs
PG_TIMEOUT = 120.0  # dist.timeout: far longer, so a collective timing out cannot pass for a fast stop
STARTUP_ALLOWANCE = 90.0  # launcher + two workers importing torch on a busy 2-core machine


def _write_config(tmp_path: Path) -> Path:
    cfg = tiny_config(
        tmp_path, dist={"timeout": PG_TIMEOUT, "failure_timeout": FAILURE_TIMEOUT}, checkpoint={"resume": "none"}
    )
    path = tmp_path / "fault.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


CASES = {
    # name: (fault environment, overrides, text the output must contain, failing rank)
    "training_step": ({"FAULT_WHERE": "step"}, [], "injected fault in training_step on rank 1", 1),
    # num_workers=1: the exception comes from a DataLoader worker process of rank 1.
    "data_loading": ({"FAULT_WHERE": "data"}, ["data.num_workers=1"], "injected fault in __getitem__ on rank 1", 1),
    # A non-daemon thread that never ends (a user's uploader) must not keep the failed rank alive.
    "hook_with_lingering_thread": (
        {"FAULT_WHERE": "hook", "FAULT_THREAD": "1"},
        [],
        "injected fault in on_step_end on rank 1",
        1,
    ),
    "validation_step": (
        {"FAULT_WHERE": "validation"},
        ["train.eval_every=3"],
        "injected fault in validation_step on rank 1",
        1,
    ),
    # Rank 0 alone writes checkpoints; its write raises an error that is not ddpkit's (NotADirectoryError).
    "rank0_save": ({"FAULT_WHERE": "save", "FAULT_RANK": "0"}, ["checkpoint.every_steps=3"], "NotADirectoryError", 0),
    # Rank 0's write meets a full disk: every rank hears it from rank 0 and stops with that one line
    # (no rank is left in a barrier to print torch's "Connection closed by peer"); both fail at once,
    # so torchrun's root cause may name either (None: any).
    "rank0_disk_full": (
        {"FAULT_WHERE": "disk_full", "FAULT_RANK": "0"},
        ["checkpoint.every_steps=3"],
        "no space left on device",
        None,
    ),
    # The same under checkpoint.async: the background write fails on rank 0; the next save (or the run's end)
    # tells every rank in the save's one broadcast, and each stops with the same one line.
    "rank0_async_disk_full": (
        {"FAULT_WHERE": "disk_full", "FAULT_RANK": "0"},
        ["checkpoint.every_steps=3", "checkpoint.async=true"],
        "no space left on device",
        None,
    ),
}
REAP_GRACE = 3.0  # seconds after the launcher's exit for the kernel to finish off its children


@dataclass
class Job:
    """One launched job and what was observed when it ended."""

    dir: Path
    proc: subprocess.Popen
    exited: float | None = None  # time.time() when the launcher exited
    survivors: dict[int, str] | None = None  # processes of this job alive REAP_GRACE after that

    @property
    def output(self) -> str:
        return (self.dir / "launcher.log").read_text(errors="replace")


def _launch(case: str, tmp: Path) -> Job:
    fault_env, overrides, _, _ = CASES[case]
    config = _write_config(tmp)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "FAULT_STAMP": str(tmp / "fault-time"),
        **fault_env,
    }
    argv = [
        sys.executable,
        "-m",
        "ddpkit",
        "run",
        str(config),
        "--nproc-per-node",
        "2",
        "--script",
        str(FAULT_SCRIPT),
        *overrides,
    ]
    with open(tmp / "launcher.log", "w") as log:
        return Job(tmp, subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO))


def _wait(job: Job) -> None:
    """Wait for the launcher to exit, then up to REAP_GRACE for every process of the job to go."""
    deadline = time.monotonic() + STARTUP_ALLOWANCE + PG_TIMEOUT
    while job.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if job.proc.poll() is None:
        return  # hung: reported by the test, killed by the fixture
    job.exited = time.time()
    while (left := processes_mentioning(str(job.dir))) and time.time() < job.exited + REAP_GRACE:
        time.sleep(0.05)
    job.survivors = left


@pytest.fixture
def launch_fault(tmp_path):
    """Runs one fault case to its end; afterwards kills whatever of it is left (by pid), if anything."""
    jobs = []

    def run(case: str) -> Job:
        jobs.append(_launch(case, tmp_path))
        _wait(jobs[-1])
        return jobs[-1]

    yield run
    for job in jobs:
        for pid in [job.proc.pid, *processes_mentioning(str(job.dir))]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.parametrize("case", list(CASES))
def test_a_fault_on_one_rank_stops_the_whole_job_quickly_and_cleanly(case, launch_fault):
    _, _, expected, failing_rank = CASES[case]
    job = launch_fault(case)
    output = job.output
    stamp = job.dir / "fault-time"
    assert stamp.exists(), f"the fault was never injected:\n{output[-3000:]}"
    assert job.exited is not None, f"{case}: the job was still running after {STARTUP_ALLOWANCE + PG_TIMEOUT:.0f}s"
    fault_to_exit = job.exited - float(stamp.read_text())
    print(f"{case}: fault to last exit {fault_to_exit:.2f}s (limit {FAILURE_TIMEOUT:g}s)")
    assert fault_to_exit < FAILURE_TIMEOUT, (
        f"{case}: {fault_to_exit:.1f}s from the fault to the last exit\n{output[-3000:]}"
    )
    assert not job.survivors, f"processes survived the job by {REAP_GRACE:g}s: {job.survivors}"
    assert job.proc.returncode == 1, output[-3000:]
    assert expected in output
    root_cause = output.split("Root Cause (first observed failure):", 1)[-1]
    if failing_rank is not None:
        assert f"rank      : {failing_rank} (local_rank: {failing_rank})" in root_cause, output[-3000:]
    else:  # every rank stopped on the same error, told to all: one line each, no traceback anywhere
        assert not [text for text in ("Traceback", "Connection closed", "TCPStore") if text in output], output[-3000:]
        assert "rank 0 could not write the checkpoint" in output, output[-3000:]
    assert expected in root_cause


# --- startup consistency: ranks that disagree stop before the first step ------------------------


class UnequalDataTrainer(ddpkit.Trainer):
    """Rank 1 sees 16 fewer training samples, as if it read another data directory."""

    def build_datasets(self):
        train, val = super().build_datasets()
        if self.rank == 1:
            train = torch.utils.data.Subset(train, range(len(train) - 16))
        return train, val


def _messages_of_failed_fits(error: type[Exception], *make_trainers: Callable[[], ddpkit.Trainer]) -> list[str]:
    """Fit each trainer in turn, each expected to raise ``error``; return the messages."""
    messages = []
    for make_trainer in make_trainers:
        with pytest.raises(error) as caught:
            make_trainer().fit()
        messages.append(str(caught.value))
    return messages


def _start_disagreeing_runs(tmp: Path) -> list[str]:
    """Runs on each rank: two runs whose ranks disagree; returns each run's ConsistencyError."""
    rank = int(os.environ["RANK"])
    return _messages_of_failed_fits(
        ConsistencyError,
        # An override given to rank 1 only: the same file, a different config.
        lambda: ddpkit.Trainer(tiny_config(tmp / "override"), overrides=["optim.lr=0.2"] if rank == 1 else []),
        # The same config, but a training set of another length on rank 1.
        lambda: UnequalDataTrainer(tiny_config(tmp / "data")),
    )


def test_ranks_that_disagree_are_stopped_at_startup_naming_field_and_values(tmp_path):
    per_rank = run_in_pool(_start_disagreeing_runs, world_size=2, args=(tmp_path,), timeout=120)
    assert per_rank[0] == per_rank[1], "every rank stops with the same message"
    override, data = per_rank[0]
    assert "  - config.optim.lr differs: rank 0: 0.1, rank 1: 0.2\n" in override, override
    assert "parameter" not in override and "dataset_length" not in override
    assert "train_dataset_length differs: rank 0: 256, rank 1: 240" in data
    assert "config." not in data  # only the dataset length differs
    for message in (override, data):
        assert "Every rank must get the same config file, overrides, data and software versions." in message
    for run in ("override", "data"):
        assert not (tmp_path / run / "run" / "model.pt").exists()


# --- data problems: refused before training, never a hang -----------------------------------------


class UnevenShardsTrainer(ddpkit.Trainer):
    """A user sampler that gives rank 0 four batches and rank 1 five."""

    def build_train_loader(self, dataset):
        sampler = _FirstN(64 + 16 * self.rank)
        return torch.utils.data.DataLoader(dataset, batch_size=self.config.data.batch_size, sampler=sampler)


class _FirstN(Sampler[int]):
    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


def _start_runs_with_bad_data(tmp: Path) -> list[str]:
    """Runs on each rank: a training set too small for 2 x 16, then uneven per-rank batch counts."""
    too_small = tiny_config(tmp / "small", data={"kwargs": {"num_train": 24, "num_val": 10, "image_size": 12}})
    return _messages_of_failed_fits(
        DataError, lambda: ddpkit.Trainer(too_small), lambda: UnevenShardsTrainer(tiny_config(tmp / "uneven"))
    )


def test_too_small_or_uneven_training_data_stops_every_rank_with_a_data_error(tmp_path):
    per_rank = run_in_pool(_start_runs_with_bad_data, world_size=2, args=(tmp_path,), timeout=120)
    assert per_rank[0] == per_rank[1]
    too_small, uneven = per_rank[0]
    assert (
        "the training set has 24 samples, fewer than world_size (2) x data.batch_size (16) = 32, "
        "so with data.drop_last=true no rank gets a full batch. "
        "Use a smaller data.batch_size, fewer processes, or data.drop_last=false."
    ) in too_small
    assert "the ranks would run different numbers of training batches per epoch (rank 0: 4, rank 1: 5)" in uneven
    assert "set data.uneven=truncate to stop every rank after 4 batches" in uneven
    for run in ("small", "uneven"):
        assert not (tmp_path / run / "run" / "model.pt").exists()


# --- debug mode -----------------------------------------------------------------------------------------


def _fit_in_debug_mode(tmp: Path) -> str | None:
    ddpkit.Trainer(tiny_config(tmp, dist={"debug": True}, train={"epochs": 1})).fit()
    return os.environ.get("TORCH_DISTRIBUTED_DEBUG")


def test_debug_mode_writes_a_step_log_per_rank(tmp_path):
    debug_env = run_in_pool(_fit_in_debug_mode, world_size=2, args=(tmp_path,), timeout=120)
    assert debug_env == ["DETAIL", "DETAIL"]
    steps_per_epoch = 256 // 2 // 16
    for rank in (0, 1):
        lines = (tmp_path / "run" / "logs" / f"steps-rank{rank}.log").read_text().splitlines()
        steps = [line for line in lines if " done (epoch " in line]
        assert [int(line.split("step ")[1].split()[0]) for line in steps] == list(range(1, steps_per_epoch + 1))
        assert re.match(r"\d\d:\d\d:\d\d\.\d{3} step 1 done \(epoch 0, batch 1\)$", steps[0])
        assert lines[-1].endswith("barrier: end of training")


def _one_rank_never_arrives() -> None:
    if int(os.environ["RANK"]) == 1:
        time.sleep(60)  # stuck (killed by run_on_ranks once rank 0 fails)
    barrier(debug=True, timeout=2)


def test_debug_barrier_names_the_rank_that_never_arrives():
    with pytest.raises(RankFailure) as caught:
        run_in_pool(_one_rank_never_arrives, world_size=2, timeout=60)
    assert "Ranks 1 failed to pass monitoredBarrier in 2000 ms" in str(caught.value)
