"""Run a function once on N fresh Gloo ranks on the CPU: for testing your Trainer subclasses (and ddpkit's).

    from ddpkit.testing import run_on_ranks

    def train_one(tmp):                      # module level, so child processes can import it
        return MyTrainer({...}).fit()

    def test_two_ranks(tmp_path):
        results = run_on_ranks(train_one, world_size=2, args=(tmp_path,), timeout=60)
        assert results[0] == results[1]

Each rank is a fresh process (a forkserver child, so torch is imported once) with the variables
torchrun would set (RANK, WORLD_SIZE, LOCAL_RANK, ...) and a default process group already
created on a ``FileStore`` in a temporary directory: no ports, nothing shared between tests. The
Trainer reuses that group. Return values come back in rank order; if any rank raises, every rank
is stopped and :class:`RankFailure` carries each failing rank's traceback; a rank that is still
running after ``timeout`` seconds is killed and reported.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddpkit.errors import EXIT_FAILURE

__all__ = ["run_on_ranks", "RankFailure", "rank_environment", "PRELOAD"]

# What the forkserver imports once, so that every rank forked from it starts with torch loaded. torch._dynamo too
# (about 1 s, sympy and all): torch.compiler.reset() imports it, and a pooled rank calls that after each function.
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "ddpkit")


class RankFailure(RuntimeError):
    """One or more ranks raised, exited abnormally or timed out."""


def rank_environment(rank: int, world_size: int) -> dict[str, str]:
    """The variables torchrun would set for ``rank`` of ``world_size`` on one host, one thread each."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "0",
        "OMP_NUM_THREADS": "1",
    }


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: tuple[Any, ...] = (),
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Call ``fn(*args)`` on ``world_size`` Gloo ranks; return the results in rank order.

    Args:
        fn: a module-level function (the ranks are fresh processes that import it by name); it runs
            with a default Gloo process group already created, which a Trainer reuses.
        world_size: how many ranks (processes).
        args: ``fn``'s arguments, pickled to every rank.
        timeout: seconds before still-running ranks are killed and reported.
        env: extra environment variables for every rank.

    Returns:
        ``fn``'s return value on each rank (picklable), index = rank.

    Raises:
        RankFailure: a rank raised (each failing rank's traceback is in the message) or timed out.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    with tempfile.TemporaryDirectory(prefix="ddpkit-ranks-") as tmp:
        workdir = Path(tmp)
        procs = [
            ctx.Process(target=_rank_main, args=(fn, args, rank, world_size, str(workdir), env or {}), daemon=False)
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        failures = _wait(procs, workdir, timeout)
        if failures:
            raise RankFailure("\n".join(failures))
        return [_read(workdir / f"result{rank}.pkl") for rank in range(world_size)]


def _wait(procs: list[Any], workdir: Path, timeout: float) -> list[str]:
    deadline = time.monotonic() + timeout
    failures: list[str] = []
    while any(p.is_alive() for p in procs):
        failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if failed or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for rank, proc in enumerate(procs):
        if proc.is_alive():
            proc.kill()
            proc.join()
            failures.append(
                f"rank {rank}: still running, killed "
                f"({'after a failure on another rank' if _failed(procs) else f'timeout {timeout:.0f}s'})"
            )
        elif proc.exitcode != 0:
            error = workdir / f"error{rank}.txt"
            failures.append(f"rank {rank}: exit code {proc.exitcode}\n{error.read_text() if error.exists() else ''}")
    return failures


def _failed(procs: list[Any]) -> bool:
    return any(p.exitcode not in (None, 0) and p.exitcode != -9 for p in procs)


def _rank_main(
    fn: Callable[..., Any], args: tuple[Any, ...], rank: int, world_size: int, workdir: str, env: dict[str, str]
) -> None:
    os.environ.update(rank_environment(rank, world_size), **env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        store = dist.FileStore(os.path.join(workdir, "store"), world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        result = fn(*args)
        with open(os.path.join(workdir, f"result{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    except BaseException:
        Path(workdir, f"error{rank}.txt").write_text(traceback.format_exc())
        # Skip interpreter teardown: peers may be blocked on a collective with us.
        os._exit(EXIT_FAILURE)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _read(path: Path) -> Any:
    with open(path, "rb") as f:
        return pickle.load(f)
