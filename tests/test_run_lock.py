"""One writer per run directory (ddpkit.checkpoint.run_lock): a second run on a live run's directory
is refused with one line naming the holder; a dead run's lock is taken over and the run resumes.

    pytest -q tests/test_run_lock.py               # the lock alone, then two real `ddpkit run`s
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers import REPO, run_cli, tiny_config

from ddpkit.checkpoint import run_lock
from ddpkit.checkpoint.files import list_checkpoints, validate_checkpoint
from ddpkit.checkpoint.run_lock import LOCK_NAME, RunDirectoryLocked, RunLock, read_holder
from ddpkit.errors import EXIT_CONFIG


def _write_lock(directory: Path, **fields) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    lock = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "start_ticks": None,
        "since": time.time(),
        "token": "theirs",
        **fields,
    }
    (directory / LOCK_NAME).write_text(json.dumps(lock))


def test_a_second_lock_on_a_live_runs_directory_is_refused_naming_the_holder(tmp_path: Path) -> None:
    first = RunLock(tmp_path)
    first.acquire()
    with pytest.raises(RunDirectoryLocked) as err:
        RunLock(tmp_path).acquire()
    message = str(err.value)
    assert (
        f"run directory {tmp_path} is in use by another run "
        f"(pid {os.getpid()} on {socket.gethostname()}, since " in message
    )
    assert "another run.name" in message and "stop that run" in message and "\n" not in message
    assert err.value.exit_code == EXIT_CONFIG
    first.release()
    assert not (tmp_path / LOCK_NAME).exists()
    again = RunLock(tmp_path)
    again.acquire()  # free again
    again.release()  # and its refresh thread stops


def test_a_dead_or_reused_pid_on_this_host_is_stale_and_taken_over(tmp_path: Path, caplog) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    _write_lock(tmp_path, pid=int(dead))
    lock = RunLock(tmp_path)
    with caplog.at_level("WARNING", logger="ddpkit"):
        lock.acquire()
    assert f"taking over the stale lock of {tmp_path} (pid {dead} on" in caplog.text
    assert read_holder(tmp_path).token == lock.token
    lock.release()
    _write_lock(tmp_path, start_ticks="1")  # this process's pid, but a process that started at another time
    reused = RunLock(tmp_path)
    reused.acquire()
    reused.release()


def test_another_hosts_lock_is_alive_while_refreshed(tmp_path: Path, monkeypatch) -> None:
    _write_lock(tmp_path, host="node-7", pid=4242)
    with pytest.raises(RunDirectoryLocked, match="pid 4242 on node-7"):
        RunLock(tmp_path).acquire()
    old = time.time() - run_lock.STALE_AFTER_S - 1
    os.utime(tmp_path / LOCK_NAME, (old, old))  # its holder stopped refreshing: the node is gone
    taken = RunLock(tmp_path)
    taken.acquire()
    taken.release()


def test_the_holder_refreshes_and_releases_only_its_own_lock(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(run_lock, "REFRESH_S", 0.05)
    lock = RunLock(tmp_path)
    lock.acquire()
    old = time.time() - 100
    os.utime(tmp_path / LOCK_NAME, (old, old))
    time.sleep(0.3)
    assert read_holder(tmp_path).age_s < 5
    _write_lock(tmp_path, token="someone else's")  # replaced by hand: not ours to remove
    lock.release()
    assert read_holder(tmp_path).token == "someone else's"


def test_an_unreadable_lock_file_counts_as_a_run_starting_there(tmp_path: Path) -> None:
    (tmp_path / LOCK_NAME).write_text("")
    with pytest.raises(RunDirectoryLocked, match="a run starting there"):
        RunLock(tmp_path).acquire()


# --- real runs ------------------------------------------------------------------------------------


def _config(tmp_path: Path) -> Path:
    cfg = tiny_config(
        tmp_path, train={"epochs": 300, "log_every": 4}, checkpoint={"every_steps": 16, "keep_last": 1000}
    )
    path = tmp_path / "lock.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _start(config: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, "-m", "ddpkit", "run", str(config), "--nproc-per-node", "2"]
    return subprocess.Popen(
        argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True
    )


def _wait_for(path: Path, proc: subprocess.Popen, limit: float = 120) -> None:
    deadline = time.time() + limit
    while not path.exists():
        assert proc.poll() is None and time.time() < deadline, f"no {path} before the run ended"
        time.sleep(0.2)


def test_a_folder_that_cannot_be_written_is_named_before_anything_is_created(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a folder")
    assert (
        run_lock.cannot_write(tmp_path / "a-file" / "run" / "checkpoints")
        == f"{tmp_path / 'a-file'} is a file, not a folder"
    )
    assert run_lock.cannot_write(tmp_path / "new" / "deeper") is None and not (tmp_path / "new").exists()
    assert run_lock.cannot_write(tmp_path) is None


@pytest.mark.multiprocess
@pytest.mark.parametrize("key", ["run.output_dir", "checkpoint.dir"])
def test_a_run_directory_below_a_file_is_refused_at_the_start_with_2(tmp_path: Path, key: str) -> None:
    """Found before the first step, on every rank, not at the first save: one line, exit 2, no traceback."""
    (tmp_path / "a-file").write_text("not a folder")
    config = tmp_path / "exp.yaml"
    config.write_text(yaml.safe_dump(tiny_config(tmp_path, checkpoint={"every_steps": 4})))
    done = run_cli("run", str(config), "--nproc-per-node", "2", f"{key}={tmp_path / 'a-file' / 'sub'}", timeout=120)
    assert done.returncode == EXIT_CONFIG, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("ddpkit: error")]
    assert lines == [
        f"ddpkit: error (rank 0): {key}: cannot write to "
        f"{tmp_path / 'a-file' / 'sub'}: {tmp_path / 'a-file'} is a file, "
        f"not a folder; point {key} at a directory this user can write"
    ], done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "step 1" not in done.stderr


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_second_run_on_a_live_runs_directory_is_refused_and_the_first_is_intact(tmp_path: Path) -> None:
    """Two real commands on one run directory: the lock is held by a live launcher, and the second command must exit 2
    while the first goes on."""
    config, run_dir = _config(tmp_path), tmp_path / "run"
    first = _start(config, tmp_path / "first.log")
    try:
        _wait_for(run_dir / "checkpoints", first)
        started = time.time()
        second = run_cli("run", str(config), "--nproc-per-node", "2", timeout=120)
        took = time.time() - started
        assert first.poll() is None, "the first run ended before the second was refused; make it longer"
    finally:
        first.wait(timeout=300)
    assert second.returncode == EXIT_CONFIG, second.stderr[-2000:]
    lines = [line for line in second.stderr.splitlines() if line.startswith("ddpkit: error")]
    assert len(lines) == 1 and f"run directory {run_dir} is in use by another run (pid " in lines[0], second.stderr[
        -2000:
    ]
    assert took < 60
    assert first.returncode == 0, (tmp_path / "first.log").read_text()[-3000:]
    steps = [
        json.loads(line)["step"]
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if '"train_loss"' in line
    ]
    assert steps == list(range(4, 300 * 8 + 1, 4))  # one record per logged step, nothing from the second run
    assert [info.step for info in list_checkpoints(run_dir / "checkpoints")] == list(range(16, 300 * 8 + 1, 16))
    assert all(validate_checkpoint(p.with_suffix(".pt")) for p in (run_dir / "checkpoints").glob("*.json"))
    assert not (run_dir / LOCK_NAME).exists() and not list(run_dir.rglob("*.tmp"))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_sigkilled_runs_lock_is_taken_over_and_the_same_command_resumes(tmp_path: Path) -> None:
    """The launcher and every worker are SIGKILLed, so the lock is left by dead processes, and the same command must
    take it over."""
    config, run_dir = _config(tmp_path), tmp_path / "run"
    doomed = _start(config, tmp_path / "doomed.log")
    _wait_for(run_dir / "checkpoints" / "step-000000032.json", doomed)
    os.killpg(doomed.pid, signal.SIGKILL)  # the launcher and every worker: nothing runs on the way out
    doomed.wait()
    assert (run_dir / LOCK_NAME).exists()
    again = run_cli("run", str(config), "--nproc-per-node", "2", timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "taking over the stale lock" in again.stderr and "resuming from" in again.stderr
    assert not (run_dir / LOCK_NAME).exists()
