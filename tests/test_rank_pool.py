"""ddpkit.testing's pool of live ranks: results like fresh ranks, a reset between functions, and failures.

    .venv/bin/pytest -q tests/test_rank_pool.py

The pool is what the rest of the suite runs its multi-rank functions on (``helpers.run_in_pool``); these
tests hold it to what ``run_on_ranks`` gives: the same results, nothing carried from one function to the
next, and a raise, a death, a hang or a leaked thread reported with each rank's part and followed by a
fresh pool.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist
from helpers import tiny_config

import ddpkit
from ddpkit.testing import RankFailure, RankPool, RankPools, run_on_ranks

pytestmark = pytest.mark.multiprocess


class _CountingTrainer(ddpkit.Trainer):
    """A user's subclass: counts its steps through a hook."""

    def on_fit_start(self) -> None:
        self.hook_steps = 0

    def on_step_end(self, step: int) -> None:
        self.hook_steps += 1


def _train(tmp: str) -> dict:
    trainer = _CountingTrainer(tiny_config(tmp, train={"epochs": 1}))
    trainer.fit()
    weights = {k: v.clone() for k, v in trainer.unwrapped_model.state_dict().items()}
    return {"steps": trainer.hook_steps, "weights": weights, "pid": os.getpid()}


def _leave_traces() -> dict:
    """Changes a fresh rank would not have; returns what this rank saw on arrival."""
    seen = {
        "env": os.environ.get("POOL_TEST_MARK"),
        "handler": signal.getsignal(signal.SIGUSR2),
        "rand": torch.rand(3),
        "grad": torch.is_grad_enabled(),
        "dtype": torch.get_default_dtype(),
        "cwd": os.getcwd(),
        "start_method": multiprocessing.get_start_method(allow_none=True),
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
    }
    os.environ["POOL_TEST_MARK"] = "left behind"
    signal.signal(signal.SIGUSR2, lambda *_: None)
    torch.manual_seed(1234)
    torch.set_grad_enabled(False)
    torch.set_default_dtype(torch.float64)
    os.chdir("/")
    multiprocessing.set_start_method("spawn", force=True)
    dist.new_group([0])
    return seen


def _raise_on_rank_1() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank 1 refuses this batch")
    dist.barrier()


def _rank_0_hangs() -> None:
    if dist.get_rank() == 0:
        time.sleep(600)
    dist.barrier()


def _leak_a_thread() -> None:
    threading.Thread(target=time.sleep, args=(60,), name="forgotten-poller", daemon=True).start()


def _sleep_then(value: int) -> int:
    time.sleep(3)
    return value


class _Interrupted(Exception):
    """What pytest-timeout or Ctrl-C raises in the test while the ranks still run."""


def _sum_of_ranks() -> int:
    total = torch.tensor(dist.get_rank())
    dist.all_reduce(total)
    return int(total)


def test_a_trainer_trained_twice_in_a_pool_ends_as_in_fresh_ranks(tmp_path):
    fresh = run_on_ranks(_train, 3, args=(str(tmp_path / "fresh"),), timeout=120)
    with RankPool(3) as pool:
        first = pool.run(_train, args=(str(tmp_path / "first"),), timeout=120)
        second = pool.run(_train, args=(str(tmp_path / "second"),), timeout=120)
    for rank in range(3):
        # The same processes ran both functions ...
        assert first[rank]["pid"] == second[rank]["pid"] != fresh[rank]["pid"]
        for run in (first, second):
            assert run[rank]["steps"] == fresh[rank]["steps"] == 5
            # ... and each ended bitwise where fresh ranks end.
            for name, tensor in fresh[rank]["weights"].items():
                assert torch.equal(run[rank]["weights"][name], tensor), name


def test_each_function_finds_the_rank_as_a_fresh_process_has_it():
    with RankPool(2) as pool:
        first = pool.run(_leave_traces, env={"POOL_TEST_MARK": "given"})
        second = pool.run(_leave_traces)
    fresh = run_on_ranks(_leave_traces, 2)
    for rank in (0, 1):
        assert first[rank]["env"] == "given" and second[rank]["env"] is None
        assert second[rank]["handler"] == fresh[rank]["handler"] == signal.SIG_DFL
        # torch's generator as forked from the same server: the same first numbers in every function
        assert torch.equal(first[rank]["rand"], second[rank]["rand"])
        assert torch.equal(second[rank]["rand"], fresh[rank]["rand"])
        assert second[rank]["grad"] is True and second[rank]["dtype"] == torch.float32
        assert second[rank]["cwd"] == first[rank]["cwd"] == fresh[rank]["cwd"]
        assert second[rank]["start_method"] == first[rank]["start_method"] == fresh[rank]["start_method"]
        assert (second[rank]["rank"], second[rank]["world"]) == (rank, 2)


def test_a_raise_a_hang_and_a_leaked_thread_fail_with_each_ranks_part_and_the_next_call_passes():
    pools = RankPools()
    try:
        with pytest.raises(RankFailure) as raised:
            pools.run(_raise_on_rank_1, 3, timeout=60)
        assert "rank 1: raised" in str(raised.value)
        assert "ValueError: rank 1 refuses this batch" in str(raised.value)

        started = time.monotonic()
        with pytest.raises(RankFailure) as hung:
            pools.run(_rank_0_hangs, 3, timeout=2)
        assert time.monotonic() - started < 30
        report = str(hung.value)
        assert "rank 0: still running, killed (timeout 2s)" in report
        # Each rank's stacks at the timeout: where rank 0 sleeps, where the others wait for it
        assert "in _rank_0_hangs" in report and "in barrier" in report

        with pytest.raises(RankFailure, match=r"rank 0: left 1 thread\(s\) running: forgotten-poller"):
            pools.run(_leak_a_thread, 3)

        assert pools.run(_sum_of_ranks, 3) == [3, 3, 3]
    finally:
        pools.close()


def test_the_rank_pool_fixture_is_the_session_pools_that_run_in_pool_uses(rank_pool):
    from helpers import run_in_pool

    assert isinstance(rank_pool, RankPools)
    assert rank_pool.run(_sum_of_ranks, 2) == run_in_pool(_sum_of_ranks, 2) == [1, 1]
    assert rank_pool.pool(2) is rank_pool.pool(2)


def test_an_interrupted_call_ends_its_pool_so_a_late_reply_never_answers_the_next_call():
    pools = RankPools()

    def interrupt(*_: object) -> None:
        raise _Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        interrupted = pools.pool(2)
        signal.alarm(1)
        with pytest.raises(_Interrupted):
            interrupted.run(_sleep_then, args=(7,))
        assert not interrupted.alive
        # The interrupted pool is gone: this call gets fresh ranks and its own answer, not the 7s still on the way.
        assert pools.run(_sum_of_ranks, 2) == [1, 1]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        pools.close()
