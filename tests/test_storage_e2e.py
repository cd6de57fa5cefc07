"""``checkpoint.dir: s3://...`` end to end: 2 Gloo ranks under ``ddpkit run``, every process SIGKILLed mid-run,
the same command resumed on an empty disk from a real local S3 server (moto's), bitwise equal to a run never
interrupted; a second run on the same URL refused by the lock on the store.

    .venv/bin/pytest -q -m slow tests/test_storage_e2e.py
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers import REPO, assert_bitwise_equal, load_weights, run_cli, tiny_config
from storage_server import s3_server, s3_url  # noqa: F401 (fixtures, found by name)

from ddpkit.checkpoint import checkpointer
from ddpkit.checkpoint.storage.layout import find_remote
from ddpkit.checkpoint.storage.lease import LOCK_OBJECT
from ddpkit.checkpoint.storage.store import open_store

pytestmark = [
    pytest.mark.slow,
    pytest.mark.multiprocess,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        "RemoteMirror" not in Path(checkpointer.__file__).read_text(),
        reason="the Checkpointer does not call RemoteMirror yet (docs/storage.md)",
    ),
]
STEPS_PER_EPOCH, EVERY = 8, 16  # 256 digits, 16 a batch, 2 ranks


def _config(directory: Path, url: str | None, mode: str = "ddp") -> Path:
    cfg = tiny_config(
        directory,
        train={"epochs": 40, "log_every": 8},
        parallel={"mode": mode},
        checkpoint={"every_steps": EVERY, "keep_last": 2, "dir": url},
    )
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.yaml").write_text(yaml.safe_dump(cfg))
    return directory / "config.yaml"


def _run(config: Path) -> subprocess.CompletedProcess:
    done = run_cli("run", str(config), "--nproc-per-node", "2", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.parametrize("mode", ["ddp", "zero1"])  # zero1: a sharded checkpoint, one object per rank's file
def test_killed_everywhere_and_resumed_from_the_bucket_on_an_empty_disk_bitwise(mode, s3_url, tmp_path):  # noqa: F811
    """Every process of the job (the launcher, both ranks and the upload process) is SIGKILLed mid-upload, as a lost
    machine would be."""
    store = open_store(s3_url)
    paused = 3 * EVERY + 2  # rank 0 pauses there: step 48's checkpoint is saved and uploading, the run is mid-way
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "PAUSE_AT_STEP": str(paused),
        "PAUSE_DIR": str(tmp_path),
    }
    first = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ddpkit",
            "run",
            str(_config(tmp_path / "first", s3_url, mode)),
            "--nproc-per-node",
            "2",
            "--script",
            str(REPO / "tests/scripts/paused_trainer.py"),
        ],
        cwd=REPO,
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "paused").exists() or not (remote := find_remote(store)) or remote[0].step < 3 * EVERY:
            assert first.poll() is None, f"the run ended before it was killed:\n{first.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline, "no checkpoint reached the bucket"
            time.sleep(0.2)
        second = run_cli("run", str(_config(tmp_path / "second", s3_url, mode)), "--nproc-per-node", "2", timeout=180)
        assert second.returncode == 2, second.stderr[-3000:]
        assert f"checkpoint.dir={s3_url} is in use by another run" in second.stderr
        assert first.poll() is None, "the first run ended before it was killed"
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the launcher, both ranks and the upload process: a lost machine
        first.wait()
    newest = find_remote(store)[0].step
    assert newest == 3 * EVERY

    resumed = _run(_config(tmp_path / "fresh", s3_url, mode))  # a new machine: nothing in its output folder
    name = f"step-{newest:09d}.{'pt' if mode == 'ddp' else 'dcp'}"
    assert f"fetched {name} (step {newest}) from {s3_url}" in resumed.stderr
    assert f"resuming from {tmp_path}/fresh/run/checkpoints/{name}" in resumed.stderr
    clean = _run(_config(tmp_path / "clean", None, mode))
    final = load_weights(tmp_path / "fresh/run/model.pt")
    assert_bitwise_equal(final, load_weights(tmp_path / "clean/run/model.pt"))
    # keep_last 2 and the one resumed from (protected); a checkpoint queued behind a slow upload gives way to a newer
    steps = [c.step for c in find_remote(store)]
    assert steps[0] == 40 * STEPS_PER_EPOCH and steps[-1] == newest and len(steps) <= 3
    assert store.get_bytes("model.pt") == (tmp_path / "fresh/run/model.pt").read_bytes()
    assert store.get_bytes(LOCK_OBJECT) is None and "resuming from" not in clean.stderr
