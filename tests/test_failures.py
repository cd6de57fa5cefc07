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
from pathlib import Path

import pytest
import torch
from helpers import REPO, tiny_config
from torch.utils.data import Sampler, TensorDataset

import ddpkit
from ddpkit import ConsistencyError, DataError
from ddpkit.distributed import barrier
from ddpkit.testing import RankFailure, run_on_ranks

pytestmark = pytest.mark.multiprocess

FAULT_SCRIPT = REPO / "tests" / "scripts" / "fault_trainer.py"
FAILURE_TIMEOUT = 15.0  # dist.failure_timeout of these jobs
PG_TIMEOUT = 120.0  # dist.timeout: far longer, so a collective timing out cannot pass for a fast stop
STARTUP_ALLOWANCE = 90.0  # launcher + two workers importing torch on a busy 2-core machine


def _write_config(tmp_path: Path) -> Path:
    path = tmp_path / "fault.yaml"
    path.write_text(
        f"""
run: {{name: fault, output_dir: {tmp_path / "run"}, seed: 0}}
data: {{name: digits, batch_size: 16, kwargs: {{num_train: 256, num_val: 64, image_size: 12}}}}
model: {{name: mlp, kwargs: {{in_features: 144, hidden: [32]}}}}
optim: {{name: sgd, lr: 0.1}}
train: {{epochs: 2, log_every: 4}}
checkpoint: {{every_epochs: null, resume: none}}
log: {{progress_bar: false}}
dist: {{timeout: {PG_TIMEOUT}, failure_timeout: {FAILURE_TIMEOUT}}}
"""
    )
    return path


def _processes_mentioning(marker: str) -> dict[int, str]:
    """pid -> command line of every process (but this one) whose command line contains ``marker``."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # exited meanwhile
        if marker in cmdline:
            found[int(entry.name)] = cmdline
    return found


def _survivors(marker: str, grace: float = 3.0) -> dict[int, str]:
    """Processes still mentioning ``marker`` after ``grace`` seconds for the kernel to reap exits."""
    deadline = time.monotonic() + grace
    while (left := _processes_mentioning(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _kill(pids: dict[int, str]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


CASES = {
    # name: (fault environment, overrides, text the output must contain, failing rank)
    "training_step": ({"FAULT_WHERE": "step"}, [], "injected fault in training_step on rank 1", 1),
    # num_workers=1: the exception comes from a DataLoader worker process of rank 1.
    "data_loading": ({"FAULT_WHERE": "data"}, ["data.num_workers=1"], "injected fault in __getitem__ on rank 1", 1),
    # A non-daemon thread that never ends (a user's uploader) must not keep the failed rank alive.
    "hook_with_lingering_thread": (
        {"FAULT_WHERE": "hook", "FAULT_THREAD": "1"}, [], "injected fault in on_step_end on rank 1", 1,
    ),
    "validation_step": ({"FAULT_WHERE": "validation"}, ["train.eval_every=3"], "injected fault in validation_step on rank 1", 1),
    # Rank 0 alone writes checkpoints; its checkpoint.dir lies below a regular file, so mkdir fails.
    "rank0_save": ({"FAULT_WHERE": "save", "FAULT_RANK": "0"}, ["checkpoint.every_steps=3"], "NotADirectoryError", 0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_fault_on_one_rank_stops_the_whole_job_quickly_and_cleanly(case, tmp_path):
    fault_env, overrides, expected, failing_rank = CASES[case]
    config = _write_config(tmp_path)
    stamp = tmp_path / "fault-time"
    if case == "rank0_save":
        (tmp_path / "not-a-dir").write_text("a file where the checkpoint directory should be")
        overrides = [*overrides, f"checkpoint.dir={tmp_path / 'not-a-dir' / 'checkpoints'}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "FAULT_STAMP": str(stamp), **fault_env}
    argv = [sys.executable, "-m", "ddpkit", "run", str(config), "--nproc-per-node", "2", "--script", str(FAULT_SCRIPT), *overrides]
    log_path = tmp_path / "launcher.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        try:
            proc.wait(timeout=STARTUP_ALLOWANCE + PG_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        finished = time.time()
    output = log_path.read_text(errors="replace")
    left = _survivors(str(tmp_path))
    _kill(left)

    assert stamp.exists(), f"the fault was never injected:\n{output[-3000:]}"
    fault_to_exit = finished - float(stamp.read_text())
    print(f"{case}: fault to last exit {fault_to_exit:.2f}s (limit {FAILURE_TIMEOUT:g}s)")
    assert not left, f"processes survived the job: {left}"
    assert proc.returncode == 1, output[-3000:]
    assert fault_to_exit < FAILURE_TIMEOUT, f"{case}: {fault_to_exit:.1f}s from the fault to the last exit\n{output[-3000:]}"
    assert expected in output
    root_cause = output.split("Root Cause (first observed failure):", 1)[-1]
    assert f"rank      : {failing_rank} (local_rank: {failing_rank})" in root_cause, output[-3000:]
    assert expected in root_cause
