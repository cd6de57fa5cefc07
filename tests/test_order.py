"""The index-free epoch order: a permutation for every N, uniform, world-size independent, resumable, O(1) memory.

The fast tests need no process group (samplers with explicit ranks); the 10**9-sample tests run in
a subprocess under an address-space limit that an 8 GB ``torch.randperm(10**9)`` cannot fit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from helpers import REPO
from torch.utils.data import Dataset

from ddpkit.data.elastic import GlobalBatchSampler
from ddpkit.data.order import AUTO_THRESHOLD, FeistelOrder, RandpermOrder, epoch_order
from ddpkit.data.samplers import ResumableDistributedSampler


class Sized(Dataset):
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 13, 16, 17, 31, 64, 97, 127, 128, 1000, 1024, 4099, 65536, 65537])
def test_every_index_comes_exactly_once(n):
    for seed, epoch in [(0, 0), (1, 7), (-5, 2)]:
        order = FeistelOrder(n, seed=seed, epoch=epoch).at(np.arange(n))
        assert sorted(order.tolist()) == list(range(n))


def test_the_order_depends_on_seed_and_epoch_only():
    first = FeistelOrder(10_000, seed=4, epoch=2).at(np.arange(100))
    assert np.array_equal(first, FeistelOrder(10_000, seed=4, epoch=2).at(np.arange(100)))
    assert not np.array_equal(first, FeistelOrder(10_000, seed=4, epoch=3).at(np.arange(100)))
    assert not np.array_equal(first, FeistelOrder(10_000, seed=5, epoch=2).at(np.arange(100)))
    positions = np.array([5, 99, 7])  # any position directly, in any order
    assert np.array_equal(FeistelOrder(10_000, seed=4, epoch=2).at(positions), first[positions])


def test_positions_are_uniform_by_chi_square():
    # Where does each of 100 indices land over 2000 epochs, in 10 position bins? Uniform: 200 per cell.
    # 1000 cells, 900 degrees of freedom: the chi-square's 0.999 quantile is about 1044. Fixed seeds, no flake.
    n, epochs, bins = 100, 2000, 10
    counts = np.zeros((n, bins))
    for epoch in range(epochs):
        order = FeistelOrder(n, seed=11, epoch=epoch).at(np.arange(n))
        counts[order, np.arange(n) * bins // n] += 1
    expected = epochs / bins
    assert ((counts - expected) ** 2 / expected).sum() < 1044
    # At 10**9, the first 100_000 positions spread over 100 equal index ranges (99 d.o.f.: 0.999 quantile 148.2).
    big = FeistelOrder(10**9, seed=0, epoch=0).at(np.arange(100_000))
    hist = np.bincount(big * 100 // 10**9, minlength=100)
    assert ((hist - 1000) ** 2 / 1000).sum() < 148.2


def test_auto_keeps_randperm_below_the_threshold_so_small_runs_keep_their_order():
    assert isinstance(epoch_order(AUTO_THRESHOLD - 1, seed=0, epoch=0), RandpermOrder)
    assert isinstance(epoch_order(AUTO_THRESHOLD, seed=0, epoch=0), FeistelOrder)
    sampler = ResumableDistributedSampler(Sized(50), num_replicas=2, rank=1, seed=3, order="auto")
    plain = torch.utils.data.DistributedSampler(Sized(50), num_replicas=2, rank=1, seed=3)
    assert list(sampler) == list(plain)


@pytest.mark.parametrize("drop_last", [True, False])
def test_index_free_shards_cover_the_epoch_and_resume_at_the_exact_position(drop_last):
    data = Sized(103)
    shards = []
    for rank in range(3):
        sampler = ResumableDistributedSampler(
            data, num_replicas=3, rank=rank, seed=1, drop_last=drop_last, order="index_free"
        )
        sampler.set_epoch(4)
        shards.append(list(sampler))
        sampler.set_epoch(4, start_index=17)
        assert list(sampler) == shards[-1][17:] and len(sampler) == len(shards[-1]) - 17
    flat = [i for shard in shards for i in shard]
    assert len(set(flat)) == (102 if drop_last else 103) and len(flat) == (102 if drop_last else 105)


def test_global_batches_are_the_same_at_1_2_and_3_ranks_and_resume_mid_epoch():
    data, g = Sized(5000), 12

    def global_order(world: int, start_step: int = 0) -> list[int]:
        per_rank = []
        for rank in range(world):
            sampler = GlobalBatchSampler(
                data, global_batch_size=g, rank=rank, world_size=world, grad_accum_steps=2, seed=9, order="index_free"
            )
            sampler.set_epoch(1, start_index=start_step * g // world)
            per_rank.append(list(sampler))
        b = g // (world * 2)  # each rank's micro-batch: step k's global batch is micro-batch 0 of every rank, then 1
        steps = len(per_rank[0]) // (2 * b)
        return [
            i
            for k in range(steps)
            for a in range(2)
            for r in range(world)
            for i in per_rank[r][(2 * k + a) * b : (2 * k + a + 1) * b]
        ]

    one = global_order(1)
    assert len(one) == 5000 // g * g and len(set(one)) == len(one)
    assert global_order(2) == one and global_order(3) == one
    assert global_order(2, start_step=100) == one[100 * g :]


_FIRST_BATCH_AT_A_BILLION = textwrap.dedent("""
    import resource, sys
    from pathlib import Path
    import torch
    from torch.utils.data import Dataset
    from ddpkit.data.epochs import start_epoch
    from ddpkit.data.loaders import build_train_loader
    from ddpkit.distributed.env import DistEnv

    def status(field):
        return next(int(l.split()[1]) for l in Path("/proc/self/status").read_text().splitlines()
                    if l.startswith(field + ":"))

    class PerIndex(Dataset):
        def __init__(self, n): self.n = n
        def __len__(self): return self.n
        def __getitem__(self, i): return torch.tensor([float(i)])

    def first_batch(n, **kw):
        loader = build_train_loader(PerIndex(n), env=DistEnv(rank=1, world_size=2), batch_size=64, seed=0, **kw)
        start_epoch(loader, 5, start_batch=4)
        return next(iter(loader))

    for kw in ({}, {"global_batch_size": 256, "grad_accum_steps": 2}):
        first_batch(10_000, **kw)  # warm up: lazy imports and allocator pools are not the sampler's memory
        limit = status("VmSize") * 1024 + 2**30  # 1 GB more address space: an 8 GB permutation cannot fit
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
        before = status("VmRSS")
        batch = first_batch(10**9, **kw)
        print(len(batch), (status("VmRSS") - before) / 1024)
""")


@pytest.mark.timeout(120)
def test_a_billion_sample_epoch_starts_within_50_mb_under_an_address_space_limit():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", _FIRST_BATCH_AT_A_BILLION],
        capture_output=True,
        text=True,
        timeout=100,
        env=env,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line.split() for line in result.stdout.splitlines()]
    assert len(lines) == 2
    for size, growth_mb in lines:
        assert int(size) == 64 and float(growth_mb) < 50, result.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_trainer_on_a_billion_samples_takes_steps_and_resumes_mid_epoch_at_the_exact_position(tmp_path):
    def run(out, *stop):
        script = REPO / "tests" / "scripts" / "billion_trainer.py"
        result = subprocess.run(
            [sys.executable, str(script), str(out), *stop],
            capture_output=True,
            text=True,
            timeout=140,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            cwd=REPO,
        )
        return result, (out / "run" / "samples.txt").read_text().splitlines()

    full, full_lines = run(tmp_path / "full")
    assert full.returncode == 0, full.stderr[-3000:]
    stopped, _ = run(tmp_path / "cut", "3")
    assert "stopped after step 3" in stopped.stderr
    resumed, cut_lines = run(tmp_path / "cut")
    assert resumed.returncode == 0 and "resuming from" in resumed.stderr, resumed.stderr[-3000:]
    # steps 1-3, then (resumed from the step-2 checkpoint) steps 3-6 again: the same samples as uninterrupted
    assert cut_lines == full_lines[:3] + full_lines[2:] and len(full_lines) == 6
    assert len({i for line in full_lines for i in line.split()[1:]}) == 48


def test_a_checkpoint_records_the_order_its_run_drew_and_a_resume_that_would_draw_another_is_refused():
    from torch.utils.data import DataLoader

    from ddpkit.checkpoint.components import Components
    from ddpkit.checkpoint.resume import _legacy_order_difference
    from ddpkit.data.epochs import data_position
    from ddpkit.errors import CheckpointError

    def order_of(n: int, kind: str = "auto") -> Components:
        sampler = ResumableDistributedSampler(Sized(n), num_replicas=2, rank=0, seed=0, order=kind)
        components = Components()
        for name, part in data_position(DataLoader(Sized(n), sampler=sampler, batch_size=4)).items():
            components.register(name, part)
        return components

    small, large = order_of(1000), order_of(AUTO_THRESHOLD)
    assert small["data_order"].state_dict() == {"order": "randperm", "length": 1000}
    assert large["data_order"].state_dict() == {"order": "index_free", "length": AUTO_THRESHOLD}
    with pytest.raises(
        CheckpointError,
        match=r"drew its samples in 'randperm' order, "
        r"this one would use 'index_free'.*data\.order=randperm",
    ):
        # the set grew past 2^20 under data.order=auto
        large["data_order"].load_state_dict(small["data_order"].state_dict())
    # A checkpoint from before data.order existed drew by randperm: refused only where auto now means another order.
    legacy = {"data": {"name": "synthetic"}}
    assert (
        _legacy_order_difference(legacy, small) == []
        and _legacy_order_difference(legacy, order_of(AUTO_THRESHOLD, "randperm")) == []
    )
    assert (
        "predates it and used 'randperm'; this run would use 'index_free'" in _legacy_order_difference(legacy, large)[0]
    )
    # a newer checkpoint: its data_order part decides
    assert _legacy_order_difference({"data": {"order": "auto"}}, large) == []
