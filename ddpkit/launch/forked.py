"""Workers forked from a launcher that has already imported torch: a worker starts in a fraction of a second, not 2 s.

    preload(program)            # in the launcher, once: torch, torch._dynamo, ddpkit's trainer, the script's libraries
    torchrun_adapter.run(args, fork=True, entrypoint=run_program)   # elastic_launch, start_method="fork" (launcher.py)

A worker that torchrun starts as a new interpreter spends about 2 s before it can train, on every
attempt: 1.1 s importing torch and 0.9 s importing ``torch._dynamo``, which torch's optimizers
import on their first call (docs/goodput.md, "Restarts without a cold start"). Under ``--max-restarts``
that is paid again after every fault, by every worker, and it was most of the badput of a run
hit by faults. torch's launcher can instead start a *function* in a process forked from itself
(``start_method="fork"``); forked from a launcher that imported those modules once, a worker
starts with them loaded; the libraries the user's script imports at its top (scikit-learn, transformers...)
are imported there too (:mod:`ddpkit.launch.warm_imports`, ``DDPKIT_PRELOAD=off`` to opt out), so that a
restart after a fault costs no import at all. The program is still the one ``python -u PROGRAM`` would run: the
forked process runs it with :mod:`runpy` as ``__main__``, with the same ``sys.argv`` and
``sys.path[0]``.

What a fresh interpreter would not have inherited is undone first: the launcher's signal
handlers (torchrun's agent turns SIGTERM into an exception in its own process), its exit
handlers, its thread count, its thread name and its command line (``ps`` shows torchrun's). The
launcher forks before it starts any computation, and only for CPU workers: a forked process can use CUDA
only if its parent never initialised it (:func:`cuda_fork_problem` says whether this launcher qualifies);
``ddpkit run --worker-start subprocess`` goes back to new interpreters.

Two differences in torch's launcher remain, both handled by the caller: it reports only the first
worker it sees exit (:func:`ddpkit.launch.launcher.launch` reads the others' error files), and
after a failure it gives the other workers 30 s after its SIGTERM (not ``--shutdown-timeout``)
before SIGKILL; ddpkit's own exits do not wait that long (a frozen rank is killed by the watchdog).
"""

from __future__ import annotations

import atexit
import gc
import os
import runpy
import signal
import sys

from ddpkit.distributed.processes import proc_stat
from ddpkit.launch.torchrun_adapter import POLLING_LOGGER

__all__ = ["preload", "run_program", "quiet_polling_tracebacks", "cuda_fork_problem", "PRELOADED"]

#: What the launcher imports before forking: torch's compiler front end (its optimizers import it on
#: their first step), torch's serialization settings (its first ``torch.load`` or ``save`` reads them:
#: the checkpoint a restart loads) and everything ``ddpkit train`` and a Trainer script import.
PRELOADED = ("torch._dynamo", "torch.utils.serialization", "ddpkit.trainer", "ddpkit.cli")


def preload(program: list[str] | None = None) -> list[str]:
    """Import :data:`PRELOADED` in this (the launcher's) process, then ``program``'s libraries
    (:func:`ddpkit.launch.warm_imports.preload_program`); return the latter's names."""
    import importlib

    from ddpkit.launch.warm_imports import preload_program

    for name in PRELOADED:
        importlib.import_module(name)
    _warm_up()
    preloaded = preload_program(program) if program else []
    # What the workers inherit is never garbage in them: out of the collector's sight, a worker's full collection
    # (the Trainer's two at its end, and Python's own now and then) no longer walks the launcher's millions of
    # objects, writing to every page they live on (copy-on-write): 1.6 s each with scikit-learn preloaded.
    gc.freeze()
    return preloaded


def cuda_fork_problem() -> str | None:
    """Why workers forked from this process could not use CUDA, or None when they can.

    A forked child may initialise CUDA only if its parent never did: the launcher must not have made a CUDA
    context (``torch.cuda.is_initialized()``: a preloaded library may have), and must have asked NVML, not
    the CUDA driver, whether devices exist (``PYTORCH_NVML_BASED_CUDA_CHECK=1`` before torch's first
    ``is_available()``). For GPU workers the fork server is then a standby with everything imported and no
    CUDA context; each worker creates its own, which is the part of a GPU restart this cannot save.
    """
    import torch

    if torch.cuda.is_initialized():
        return "CUDA was initialised in the launcher (a preloaded library?): set DDPKIT_PRELOAD=off"
    if os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK") != "1":
        return "the launcher asked the CUDA driver for devices: set PYTORCH_NVML_BASED_CUDA_CHECK=1 before torch"
    return None


def _warm_up() -> None:
    """Pay here, once, what torch does on the first call of functions every worker calls at its start: the
    first step of an optimizer (about 15 ms: its dispatch tables and the compiler's ``disable`` wrappers,
    made once per process) and the first ``manual_seed``. This process's random state is left as it was."""
    import torch

    state = torch.get_rng_state()
    torch.manual_seed(0)
    torch.set_rng_state(state)
    weight = torch.nn.Parameter(torch.zeros(2))
    for optimizer in (torch.optim.SGD([weight], lr=0.1, momentum=0.9), torch.optim.AdamW([weight], lr=0.1)):
        weight.grad = torch.ones(2)
        optimizer.step()
        optimizer.zero_grad()
        optimizer.load_state_dict(optimizer.state_dict())


def quiet_polling_tracebacks() -> None:
    """Keep torch's "failed (exitcode: N) local_rank: R" line for a forked worker, without the traceback of
    torch's own polling loop it logs with it (new interpreters get the line alone); the worker's own error is in
    the summary."""
    import logging

    def drop_traceback(record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("failed (exitcode"):
            record.exc_info = None
            record.exc_text = None
        return True

    logging.getLogger(POLLING_LOGGER).addFilter(drop_traceback)


def run_program(program: list[str]) -> None:
    """Run ``program`` (``["-m", MODULE, ARG...]`` or ``[SCRIPT, ARG...]``) as ``__main__``, as a new interpreter
    would.

    ``sys.exit(0)`` or a return ends the worker successfully (torch's ``record`` wrapper takes a zero
    exit as a return); a non-zero ``sys.exit`` becomes the process's exit code.
    """
    _forget_the_launcher()
    _show_in_ps([sys.executable, "-u", *program])
    is_module = program[0] == "-m"
    target, args = (program[1], program[2:]) if is_module else (program[0], program[1:])
    sys.argv = [target, *args]
    try:
        if is_module:
            # What `python -m` puts first
            sys.path.insert(0, os.getcwd())
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            # What `python SCRIPT` puts first
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
    finally:
        # The program's own exit handlers: a forked process leaves with os._exit
        atexit._run_exitfuncs()


def _show_in_ps(argv: list[str]) -> None:
    """Make ``/proc/self/cmdline`` (what ``ps``, ``pgrep -f`` and process monitors read) the command
    line torchrun would have started, instead of the launcher's this process inherited.

    The kernel reads the command line from the process's own memory, between the ``arg_start`` and
    ``arg_end`` addresses of ``/proc/self/stat``; it is rewritten in place (cut to that length),
    as ``setproctitle`` does. Where ``/proc/self/mem`` cannot be written, the launcher's stays.
    """
    try:
        fields = proc_stat("self")
        # fields 48 and 49 of proc(5), counted after the name
        start = int(fields[45])  # type: ignore[index]
        end = int(fields[46])  # type: ignore[index]
        text = b"\0".join(os.fsencode(arg) for arg in argv)[: end - start - 1]
        with open("/proc/self/mem", "r+b", buffering=0) as mem:
            mem.seek(start)
            mem.write(text.ljust(end - start, b"\0"))
    except (OSError, ValueError, IndexError, TypeError):
        pass


def _forget_the_launcher() -> None:
    """Undo what this process inherited from the launcher that a fresh interpreter would not have."""
    for sig in signal.valid_signals():
        handler = signal.getsignal(sig)
        if callable(handler) and handler is not signal.default_int_handler:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    # The launcher's exit handlers are the launcher's
    atexit._clear()
    threads = os.environ.get("OMP_NUM_THREADS") or os.environ.get("MKL_NUM_THREADS")
    # torch read them when the launcher imported it, not now
    if threads and threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    # `python -u`: a rank's lines appear as they are written
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True)
        except (AttributeError, ValueError):
            pass
    # `ps`, `pgrep` and `top` show the interpreter's name, not the launcher thread's "pt_elastic"
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(os.path.basename(sys.executable)[:15])
    except OSError:
        pass
