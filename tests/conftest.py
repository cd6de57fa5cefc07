"""Shared fixtures: a clean environment per test, no leftover process group or ddpkit thread, one thread.

Builders that spawned ranks and scripts also need (a tiny config, a CPU runtime, subprocess runners)
live in ``tests/helpers.py``, importable as ``helpers`` because pyproject.toml puts ``tests`` on
pytest's ``pythonpath``; the fixtures below are those builders bound to one test.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml
from helpers import cpu_runtime, tiny_config

from ddpkit.distributed import Runtime

# The rank pool's fixture (``rank_pool``, per session); helpers.run_in_pool uses the same pools.
pytest_plugins = ["ddpkit.testing.fixtures"]

_LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_WORLD_SIZE",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_ERROR_FILE",
    "TORCH_DISTRIBUTED_DEBUG",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_STEP_ID",
    "SLURM_JOB_ID",
)

# Every thread ddpkit starts is named "ddpkit-..." (watchdog, watchdog-store, stop-poll, run-lock,
# checkpoint, and one per tracker). A stopped thread may need a moment to leave its last wait.
THREAD_PREFIX = "ddpkit"
THREAD_GRACE_S = 2.0


def _ddpkit_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX) and t.is_alive()}


@pytest.fixture(autouse=True)
def thread_police():
    """Fail a test that leaves a ddpkit thread running (Lightning's ``thread_police``).

    A leaked thread keeps polling a store, refreshing a lock or writing files into the next test
    and competes for the machine's cores. Threads that were running before the test are not its
    fault; the ones it started get ``THREAD_GRACE_S`` in all to finish before the test fails
    (an error at teardown naming each thread). Threads in spawned ranks end with their process.
    """
    before = _ddpkit_threads()
    yield
    deadline = time.monotonic() + THREAD_GRACE_S
    leaked = []
    for thread in sorted(_ddpkit_threads() - before, key=lambda t: t.name):
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            leaked.append(f"{thread.name} (daemon={thread.daemon})")
    if leaked:
        pytest.fail(
            f"the test left {len(leaked)} ddpkit thread(s) running: {', '.join(leaked)}; "
            "close what started them (the Trainer, the watchdog, the writer, the lock) before it ends",
            pytrace=False,
        )


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """Each test starts outside any launcher, single-threaded, and leaves no process group behind."""
    saved = dict(os.environ)
    for name in _LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # Hermetic: no test reads or fills the user's dataset cache (tests/test_data_cache.py sets its own),
    # and the fault tests' timings stay those of a first start, rendering included.
    monkeypatch.setenv("DDPKIT_CACHE_DIR", "off")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    torch.set_num_threads(threads)
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def world_of_one() -> Runtime:
    """A CPU :class:`Runtime` for a world of one (Gloo, no process group): for code that only reads it."""
    return cpu_runtime()


@pytest.fixture
def tiny_cfg(tmp_path: Path) -> dict:
    """``helpers.tiny_config(tmp_path)``: the MLP on a few hundred digits, writing under ``tmp_path/run``."""
    return tiny_config(tmp_path)


@pytest.fixture
def tiny_yaml(tmp_path: Path) -> Path:
    """The tiny config written to ``tmp_path/tiny.yaml``, for ``ddpkit run`` and the other commands."""
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config(tmp_path)))
    return path
