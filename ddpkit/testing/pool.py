"""A pool of live Gloo ranks that runs one function after another: :func:`run_on_ranks` without the start-up.

    from ddpkit.testing import RankPool

    with RankPool(3) as pool:
        first = pool.run(train_one, args=(tmp / "a",))     # rank-order results, as run_on_ranks returns
        second = pool.run(train_one, args=(tmp / "b",))    # the same 3 processes, a fresh process group

Starting ranks costs more than most multi-rank tests: a process, then every module the test imports
(the Trainer, FSDP, pipelining, transformers), then a process group. A pool pays the first two once. For
each function it creates a fresh Gloo group on a new ``FileStore``, with the variables torchrun would set
and the call's ``env``, runs the function, then resets the rank (:mod:`ddpkit.testing.reset`): groups
destroyed, environment, signals, loggers, torch's switches and every RNG as a fresh process has them.
Threads the function left running fail the call, as they would leak into the next one.

A failure ends the pool: a rank that raises (its peers may be blocked in a collective with it), a rank
that dies, a call past its timeout (each live rank's Python stacks are written at the timeout and put in
the error) or a leaked thread. :class:`RankFailure` carries each rank's part; :class:`RankPools` starts
a fresh pool for the next call. torch's private ``MultiProcContinuousTest`` is the same idea, per class.
"""

from __future__ import annotations

import faulthandler
import gc
import multiprocessing as mp
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from ddpkit.errors import EXIT_FAILURE, EXIT_OK
from ddpkit.testing.ranks import PRELOAD, RankFailure, rank_environment

# How long the ranks still running get, after one rank failed, to report a failure of their own.
PEER_GRACE_S = 1.0
# How long after the timeout the parent waits for each rank's stacks (written at the timeout itself).
STACKS_GRACE_S = 1.0
# A pool being closed gets this long to leave its loop before it is killed.
CLOSE_GRACE_S = 5.0
# How long a rank may take to start and load a function (a new process imports torch and ddpkit, then the
# function's module) before the pool fails: a function's timeout counts from when the ranks have loaded it.
LOAD_S = 300.0
#: What a rank sends once it has read a function (imported its module), before it runs it.
LOADED = b"loaded"


class RankPool:
    """``world_size`` rank processes, alive from construction to :meth:`close`, that run functions in turn.

    Args:
        world_size: how many ranks (processes); each function runs on all of them.
    """

    def __init__(self, world_size: int):
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        self.world_size = world_size
        self._dir = tempfile.TemporaryDirectory(prefix="ddpkit-pool-")
        self._calls = 0
        self._closed = False
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(PRELOAD))
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(rank, world_size, child_end, self._dir.name), daemon=False)
            proc.start()
            child_end.close()
            self._conns.append(parent_end)
            self._procs.append(proc)

    @property
    def alive(self) -> bool:
        """Whether the pool can take another function (not closed, every rank still running)."""
        return not self._closed and all(p.is_alive() for p in self._procs)

    def run(
        self,
        fn: Callable[..., Any],
        *,
        args: tuple[Any, ...] = (),
        timeout: float = 120.0,
        env: dict[str, str] | None = None,
    ) -> list[Any]:
        """Call ``fn(*args)`` on every rank with a fresh default Gloo group; return the results in rank order.

        ``fn``, ``args``, ``env`` and ``timeout`` mean what they mean to :func:`run_on_ranks`.

        Raises:
            RankFailure: a rank raised, died, timed out or left a thread running; the pool is closed.
        """
        if not self.alive:
            raise RuntimeError(f"this RankPool of {self.world_size} ranks is closed; start a new one")
        self._calls += 1
        store = os.path.join(self._dir.name, f"store{self._calls}")
        try:
            job = pickle.dumps((fn, args, dict(env or {}), store, timeout))
        except Exception as error:
            raise TypeError(f"cannot send {fn!r} and its arguments to the ranks: {error}") from error
        try:
            for conn in self._conns:
                conn.send_bytes(job)
            self._wait_until_loaded()
            results, failures = self._collect(timeout)
        except BaseException:
            # Interrupted while the ranks run (Ctrl-C, pytest-timeout): their reply would answer the next call.
            self.close(kill=True)
            raise
        if failures:
            self.close(kill=True)
            raise RankFailure("\n".join(failures[rank] for rank in sorted(failures)))
        return [results[rank] for rank in range(self.world_size)]

    def _wait_until_loaded(self) -> None:
        """Wait for every rank to have read the function: its ``timeout`` counts from then, not from a new process's
        imports or the import of the function's module (seconds on a busy machine), so that a hang's stacks are
        written before the pool stops waiting for them."""
        for rank, (conn, proc) in enumerate(zip(self._conns, self._procs)):
            if not wait([conn, proc.sentinel], timeout=LOAD_S) or not conn.poll():
                self.close(kill=True)
                raise RankFailure(f"rank {rank}: did not load the function within {LOAD_S:.0f}s")
            try:
                conn.recv_bytes()
            except EOFError:
                self.close(kill=True)
                raise RankFailure(f"rank {rank}: exit code {proc.exitcode} before it ran the function") from None

    def _collect(self, timeout: float) -> tuple[dict[int, Any], dict[int, str]]:
        """Each rank's result, or its failure; ranks still running at the end are reported as such."""
        deadline = time.monotonic() + timeout + STACKS_GRACE_S
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        # Set at the first failure: the others then get PEER_GRACE_S, not the whole timeout.
        grace_end = deadline
        while len(results) + len(failures) < self.world_size:
            limit = min(deadline, grace_end)
            waiting = [r for r in range(self.world_size) if r not in results and r not in failures]
            handles = [self._conns[r] for r in waiting] + [self._procs[r].sentinel for r in waiting]
            if not wait(handles, timeout=max(0.0, limit - time.monotonic())):
                break
            for rank in waiting:
                self._read_reply(rank, results, failures)
            if failures and grace_end == deadline:
                grace_end = time.monotonic() + PEER_GRACE_S
        after_failure = bool(failures)
        for rank in range(self.world_size):
            if rank not in results and rank not in failures:
                failures[rank] = self._still_running(rank, timeout, after_failure=after_failure)
        return results, failures

    def _read_reply(self, rank: int, results: dict[int, Any], failures: dict[int, str]) -> None:
        conn = self._conns[rank]
        proc = self._procs[rank]
        if conn.poll():
            try:
                status, payload = pickle.loads(conn.recv_bytes())
            except EOFError:
                proc.join(CLOSE_GRACE_S)
                failures[rank] = f"rank {rank}: exit code {proc.exitcode}"
                return
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                failures[rank] = f"rank {rank}: {payload}"
        elif not proc.is_alive():
            failures[rank] = f"rank {rank}: exit code {proc.exitcode}"

    def _still_running(self, rank: int, timeout: float, *, after_failure: bool) -> str:
        if after_failure:
            return f"rank {rank}: still running, killed (after a failure on another rank)"
        stacks_file = os.path.join(self._dir.name, f"stacks{rank}.txt")
        stacks = open(stacks_file).read() if os.path.exists(stacks_file) else ""
        return f"rank {rank}: still running, killed (timeout {timeout:.0f}s); its threads at the timeout:\n{stacks}"

    def close(self, *, kill: bool = False) -> None:
        """Stop the ranks (at once with ``kill``, else after their current function) and remove the pool's files."""
        if self._closed:
            return
        self._closed = True
        for conn in self._conns:
            if not kill:
                try:
                    conn.send_bytes(b"")
                except OSError:
                    pass
            conn.close()
        for proc in self._procs:
            if not kill:
                proc.join(CLOSE_GRACE_S)
            if proc.is_alive():
                proc.kill()
            proc.join()
        self._dir.cleanup()

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _serve(rank: int, world_size: int, conn: Connection, workdir: str) -> None:
    """A rank's loop: take a function, run it in a fresh process group, reply, reset; until told to stop."""
    os.environ.update(rank_environment(rank, world_size))
    import torch

    from ddpkit.testing.reset import RankState

    torch.set_num_threads(1)
    state = RankState.capture()
    # The preloaded heap (torch, ddpkit) is never garbage: kept out of the collection after each function.
    gc.freeze()
    with open(os.path.join(workdir, f"stacks{rank}.txt"), "w") as stacks:
        while True:
            try:
                job = conn.recv_bytes()
            except EOFError:
                # The test process is gone: nothing will ask again.
                break
            if not job:
                break
            status, payload = _run_one(job, rank, world_size, stacks, conn)
            if status == "ok":
                leaked = state.restore()
                if leaked:
                    status, payload = "error", f"left {len(leaked)} thread(s) running: {', '.join(leaked)}"
            conn.send_bytes(pickle.dumps((status, payload)))
            if status != "ok":
                # Peers may be blocked in a collective with this rank: the pool ends here.
                os._exit(EXIT_FAILURE)
    os._exit(EXIT_OK)


def _run_one(job: bytes, rank: int, world_size: int, stacks: Any, conn: Connection) -> tuple[str, Any]:
    import torch.distributed as dist

    stacks.seek(0)
    stacks.truncate()
    try:
        try:
            fn, args, env, store, timeout = pickle.loads(job)
        finally:
            # Loaded (or not: the error is the reply): the parent's clock for the timeout starts now.
            conn.send_bytes(LOADED)
        os.environ.update(env)
        faulthandler.dump_traceback_later(timeout, file=stacks)
        dist.init_process_group("gloo", store=dist.FileStore(store, world_size), rank=rank, world_size=world_size)
        return "ok", pickle.dumps(fn(*args))
    except BaseException:
        return "error", f"raised\n{traceback.format_exc()}"
    finally:
        faulthandler.cancel_dump_traceback_later()
