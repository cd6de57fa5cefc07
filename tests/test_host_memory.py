"""``train.keep_host_memory``: freed host memory kept in the process for reuse, or given back so that a rank's
resident memory follows what it holds (ddpkit.training.allocator).

    .venv/bin/pytest -q tests/test_host_memory.py

Each setting is process-wide and applied once, so each case runs in a fresh interpreter: it frees 256 MiB of 256 KiB
tensors (an activation's size: 64 tokens x 1,024 features in fp32) and reports its resident memory before and
after.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ddpkit.training.allocator import keeps_host_memory

_FREE_256_MIB = """
import json, sys
from pathlib import Path
import torch
from ddpkit.training import allocator

def rss():
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024

applied = {"keep": allocator.keep_freed_host_memory, "give back": allocator.give_back_host_memory}[sys.argv[1]]()
start = rss()
# 1,024 tensors of 256 KiB, each written so its pages are resident, then all freed
blocks = [torch.ones(64 * 1024) for _ in range(1024)]
held = rss()
del blocks
print(json.dumps({"applied": applied, "held": held - start, "after": rss() - start}))
"""


def _free_256_mib(setting: str) -> dict:
    done = subprocess.run([sys.executable, "-c", _FREE_256_MIB, setting], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_kept_memory_stays_in_the_process_and_given_back_memory_leaves_it():
    kept, given = _free_256_mib("keep"), _free_256_mib("give back")
    assert kept["applied"] and given["applied"]
    assert kept["held"] > 250 and given["held"] > 250
    # kept: the freed blocks stay resident for the next step's tensors of the same sizes
    assert kept["after"] > 250
    # given back: every 256 KiB block was mapped and is unmapped when freed
    assert given["after"] < 20


def test_null_keeps_where_every_rank_holds_the_whole_model_and_gives_back_where_the_layout_splits_it():
    assert keeps_host_memory(None, splits_model=False) is True
    assert keeps_host_memory(None, splits_model=True) is False
    assert keeps_host_memory(True, splits_model=True) is True
    assert keeps_host_memory(False, splits_model=False) is False
