"""Shared fixtures: a clean environment per test, no leftover process group, one thread."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]

# Helpers shared by the test modules (importable as `helpers` from the tests directory).
sys.path.insert(0, str(Path(__file__).parent))

_LAUNCHER_VARS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_WORLD_SIZE",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_ERROR_FILE", "TORCH_DISTRIBUTED_DEBUG",
    "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_STEP_ID", "SLURM_JOB_ID",
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
