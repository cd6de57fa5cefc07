"""What a pooled rank puts back between two test functions, so the second starts as in a fresh process.

A :class:`~ddpkit.testing.pool.RankPool` keeps its rank processes (and everything they imported) alive
from one function to the next. :class:`RankState` is the picture of a rank taken once, when the process
starts; :meth:`RankState.restore` puts the process back into that picture after each function:

- every process group destroyed (the default one and every subgroup and mesh built on it);
- the environment, the working directory, ``sys.path``, signal handlers, warning filters, loggers and
  multiprocessing's start method;
- torch's process-wide switches (default dtype, grad mode, deterministic algorithms, threads,
  matmul precision, compiled graphs, Inductor's compile workers) and every random generator, seeded as a new
  process seeds them;
- DTensor's sharding propagation caches, and ddpkit's own process-wide caches;

and it names the Python threads the function left running, which a fresh process would not have.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import random
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

# A thread the function stopped may need a moment to leave its last wait.
THREAD_GRACE_S = 2.0
_UNCATCHABLE = {signal.SIGKILL, signal.SIGSTOP}


@dataclass
class _LoggerState:
    level: int
    handlers: list[logging.Handler]
    propagate: bool
    disabled: bool

    @classmethod
    def of(cls, logger: logging.Logger) -> _LoggerState:
        return cls(logger.level, list(logger.handlers), logger.propagate, logger.disabled)

    def apply(self, logger: logging.Logger) -> None:
        for handler in logger.handlers:
            if handler not in self.handlers:
                handler.close()
        logger.handlers[:] = self.handlers
        # setLevel clears every logger's cache: only where the level changed
        if logger.level != self.level:
            logger.setLevel(self.level)
        logger.propagate = self.propagate
        logger.disabled = self.disabled


@dataclass
class RankState:
    """One rank's process-wide state, captured with :meth:`capture` and put back with :meth:`restore`."""

    environ: dict[str, str]
    cwd: str
    path: list[str]
    handlers: dict[int, Any]
    filters: list[Any]
    loggers: dict[str, _LoggerState]
    threads: set[threading.Thread]
    default_dtype: torch.dtype
    matmul_precision: str
    num_threads: int
    start_method: str | None
    torch_rng: torch.Tensor
    numpy_rng: Any
    deterministic: tuple[bool, bool] = field(default=(False, False))

    @classmethod
    def capture(cls) -> RankState:
        """The state of this process now: call it once, before the first function runs."""
        return cls(
            environ=dict(os.environ),
            cwd=os.getcwd(),
            path=list(sys.path),
            handlers={sig: signal.getsignal(sig) for sig in _catchable_signals()},
            filters=list(warnings.filters),
            loggers={name: _LoggerState.of(logger) for name, logger in _loggers().items()},
            threads=set(threading.enumerate()),
            default_dtype=torch.get_default_dtype(),
            matmul_precision=torch.get_float32_matmul_precision(),
            num_threads=torch.get_num_threads(),
            start_method=multiprocessing.get_start_method(allow_none=True),
            torch_rng=torch.get_rng_state(),
            numpy_rng=sys.modules["numpy"].random.get_state() if "numpy" in sys.modules else None,
            deterministic=(
                torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled(),
            ),
        )

    def restore(self) -> list[str]:
        """Put the process back as captured; return the names of the threads a function left running."""
        if dist.is_available() and dist.is_initialized():
            # The default group's destruction takes every subgroup (and so every mesh) with it.
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        sys.path[:] = self.path
        for sig, handler in self.handlers.items():
            if handler is not None:
                signal.signal(sig, handler)
        warnings.filters[:] = self.filters
        multiprocessing.set_start_method(self.start_method, force=True)
        self._restore_loggers()
        self._restore_torch()
        self._reseed()
        _reset_dtensor_caches()
        _reset_ddpkit_caches()
        # What the function left unreachable goes now, loaders' finalizers included.
        gc.collect()
        return self._leaked_threads()

    def _restore_loggers(self) -> None:
        for name, logger in _loggers().items():
            self.loggers.get(name, _LoggerState(logging.NOTSET, [], True, False)).apply(logger)

    def _restore_torch(self) -> None:
        torch.set_default_dtype(self.default_dtype)
        torch.set_grad_enabled(True)
        torch.autograd.set_detect_anomaly(False)
        torch.set_float32_matmul_precision(self.matmul_precision)
        torch.set_num_threads(self.num_threads)
        enabled, warn_only = self.deterministic
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        if "torch._dynamo" in sys.modules:
            # Compiled graphs and their guards are per process: a second test must compile afresh.
            torch.compiler.reset()
        if "torch._inductor.async_compile" in sys.modules:
            _stop_compile_workers(sys.modules["torch._inductor.async_compile"])

    def _reseed(self) -> None:
        """Every generator as a fresh rank has it: torch's and NumPy's as forked, Python's from the OS."""
        torch.set_rng_state(self.torch_rng)
        # Python's own generator is reseeded from the OS in every forked child (``os.register_at_fork``).
        random.seed()
        if self.numpy_rng is not None:
            sys.modules["numpy"].random.set_state(self.numpy_rng)

    def _leaked_threads(self) -> list[str]:
        deadline = time.monotonic() + THREAD_GRACE_S
        leaked = []
        for thread in sorted(set(threading.enumerate()) - self.threads, key=lambda t: t.name):
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                leaked.append(f"{thread.name} (daemon={thread.daemon})")
        return leaked


def _stop_compile_workers(async_compile: Any) -> None:
    """Inductor's compile workers (a thread pool and process pools), ended as a process that never compiled has none.

    torch has no public call for this: ``torch.compiler.reset()`` keeps them, and a fresh rank ends them with its
    process. ``shutdown_compile_workers`` ends the process pools; the thread pool is an ``lru_cache`` of its own.
    """
    async_compile.shutdown_compile_workers()
    thread_pool = async_compile.AsyncCompile.pool
    if thread_pool.cache_info().currsize:
        thread_pool().shutdown(wait=True)
        thread_pool.cache_clear()


def _catchable_signals() -> list[int]:
    return sorted(sig for sig in signal.valid_signals() if sig not in _UNCATCHABLE)


def _loggers() -> dict[str, logging.Logger]:
    named = {
        name: logger for name, logger in logging.root.manager.loggerDict.items() if isinstance(logger, logging.Logger)
    }
    return {"": logging.root, **named}


def _reset_dtensor_caches() -> None:
    """DTensor's sharding propagation, as a fresh process has it: empty. Its caches key on a ``DeviceMesh``, whose
    equality ignores the process groups, so an entry from the last function would hand this one an output laid out
    on the last function's mesh, whose groups were destroyed (``Could not resolve the process group``)."""
    if "torch.distributed.tensor._api" not in sys.modules:
        return
    # torch's own clearing of both caches, its C++ fast path's and Python's (torch.distributed.tensor.debug)
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()


def _reset_ddpkit_caches() -> None:
    """ddpkit's module-level state, as a process that never ran a Trainer has it (only modules already loaded)."""
    heartbeat = sys.modules.get("ddpkit.watchdog.heartbeat")
    if heartbeat is not None:
        if heartbeat._current is not None:
            # A failed run's watchdog keeps its store client open for the process's exit (announce_failure).
            heartbeat._current.client.close()
        heartbeat._current = None
        # Ranks name their watchdog's store keys by this count: each function's ranks start it at 0 together.
        heartbeat._generation = 0
    sharding = sys.modules.get("ddpkit.distributed.gradient_norm")
    if sharding is not None:
        sharding._last_tiling = None
    control_auth = sys.modules.get("ddpkit.distributed.control_auth")
    if control_auth is not None:
        control_auth._key = None
    launcher_env = sys.modules.get("ddpkit.distributed.launcher_env")
    if launcher_env is not None:
        launcher_env._broadcast_rank0_host.cache_clear()
    _stop_tqdm_monitor()
    streaming = sys.modules.get("ddpkit.data.streaming")
    if streaming is not None:
        # Its once-per-process notes are logged again, as a fresh process logs them.
        streaming._note_once.cache_clear()


def _stop_tqdm_monitor() -> None:
    """End tqdm's monitor thread (one per process, started by the first bar ddpkit's progress shows)."""
    if "tqdm.std" not in sys.modules:
        return
    classes = [sys.modules["tqdm.std"].tqdm]
    while classes:
        cls = classes.pop()
        classes.extend(cls.__subclasses__())
        monitor = cls.__dict__.get("monitor")
        if monitor is not None:
            monitor.exit()
            cls.monitor = None
