"""The worker side of a launch: run a training entry point so that failures are clear, reach
torchrun's summary and stop the job.

    run_trainer(MyTrainer, "config.yaml", ["optim.lr=0.1"])   # Trainer.main and `ddpkit train`
    run_entrypoint(job)                                         # any worker function (the bench worker)

``Trainer.main`` parses its command line once with :func:`parse_worker_argv`; ``ddpkit train``
has argparse's result. Both then run ``cls(CONFIG, overrides=...).fit()`` through ``run_trainer``.
``run_entrypoint(fn)`` calls ``fn`` under torch's ``@record``, which writes an unexpected exception
and its traceback to the error file torchrun reads, so the failing rank's traceback appears in
the launcher's summary. A :class:`~ddpkit.errors.DdpkitError` (bad config, bad launch,
bad data, bad checkpoint) is the user's to fix, not a bug: it is printed as one clear message,
recorded in the error file without a traceback, and becomes the exit code (2 for config and data errors,
4 for an unhealthy run, ``run.requeue_exit_code`` (75) for a signal-stopped run, else 1; all defined
in :mod:`ddpkit.errors`).

In a job of several ranks, a rank that failed exits at once (see :func:`_exit_now`), so the
ranks waiting for it in a collective are told within moments instead of after the process-group
timeout.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ddpkit.checkpoint.preemption import Preempted
from ddpkit.config.overrides import UNSET
from ddpkit.distributed.env import read_dist_env
from ddpkit.errors import EXIT_FAILURE, EXIT_OK, DdpkitError, LaunchError, check_requeue_exit_code, report_error
from ddpkit.watchdog.store_io import terminate, write_error_file

__all__ = ["run_entrypoint", "run_trainer", "parse_worker_argv"]


def parse_worker_argv(
    argv: Sequence[str] | None = None, *, usage: str = "", defaults: Sequence[str] = ()
) -> tuple[str | None, list[str]]:
    """``[CONFIG] [key=value ...]`` (default ``sys.argv[1:]``) -> (CONFIG or None, overrides).

    A config path has no ``=`` and does not start with ``~`` (``~key``, Hydra's way to put a key back
    to its default, is an override). ``-h`` / ``--help`` prints the usage and ``usage`` and exits 0.
    ``defaults``: a script's own ``key=value`` settings, first; a key the command line sets (or a
    section it sets whole) replaces its default: the default is left out, so the warning that names a
    replaced override (the last one wins) is only ever about the user's own command line.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(f"usage: {os.path.basename(sys.argv[0])} [CONFIG.yaml] [key.sub=value ...]\n\n{usage}")
        sys.exit(EXIT_OK)
    path = args.pop(0) if args and "=" not in args[0] and not args[0].startswith(UNSET) else None
    given = [arg.split("=", 1)[0].strip() for arg in args]
    kept = [d for d in defaults if not any(_key(d) == g or _key(d).startswith(g + ".") for g in given)]
    return path, [*kept, *args]


def _key(override: str) -> str:
    return override.split("=", 1)[0].strip()


def run_trainer(cls: Any, config: str | None, overrides: Sequence[str] = ()) -> None:
    """Run ``cls(config, overrides=overrides).fit()`` as a worker; exit non-zero on failure.

    A run stopped by a signal after saving exits with ``run.requeue_exit_code`` (75 by default): the
    code the cluster's retry rules read as "requeue me" (:data:`ddpkit.errors.EXIT_CODES`)."""

    def fit() -> None:
        trainer = cls(config, overrides=overrides)
        # Refused now, not at the preemption
        requeue = check_requeue_exit_code(trainer.config.run.requeue_exit_code)
        try:
            trainer.fit()
        except Preempted as exc:
            exc.exit_code = requeue
            raise

    code = run_entrypoint(fit)
    if code:
        sys.exit(code)
    # The finished Trainer is garbage in reference cycles; what it held may still hold the process
    # group (a ZeRO optimizer does). Free it now, while the group's threads can take the GIL, not
    # during interpreter shutdown (see ddpkit.distributed.process_group._destroy).
    gc.collect()


def run_entrypoint(fn: Callable[[], Any]) -> int:
    """Run ``fn``; return 0 on success or the exit code of the DdpkitError it raised.

    When this process is one rank of several, a failure does not return or raise: the error is
    printed and recorded, and the process exits with the error's code right away.
    """
    from torch.distributed.elastic.multiprocessing.errors import record

    peers = _has_peers()

    def guarded() -> int:
        try:
            fn()
        except Exception as exc:
            return _on_failure(exc, peers=peers)
        return EXIT_OK

    try:
        code = record(guarded)()
    except Exception:
        if not peers:
            raise
        # What the interpreter would print on its way out
        sys.excepthook(*sys.exc_info())
        code = EXIT_FAILURE
    if code and peers:
        _exit_now(code)
    return code


def _on_failure(exc: Exception, *, peers: bool) -> int:
    """Report a DdpkitError (message, error file) and return its exit code; re-raise anything else."""
    if peers and threading.current_thread() is threading.main_thread():
        # torchrun's agent sends SIGTERM to every rank the moment the first one exits; a
        # rank killed while writing its error file leaves torchrun a truncated file
        # ("Failed to parse reply file") instead of its error. What is left to do is
        # short and the agent's SIGKILL after --shutdown-timeout still bounds it.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # A signal-stopped run has saved; nobody failed
    if peers and not isinstance(exc, Preempted):
        from ddpkit.watchdog.heartbeat import announce_failure

        # fit() told the store why it failed: let ranks on other nodes read it first
        announce_failure()
    if not isinstance(exc, DdpkitError):
        # record() writes the traceback to torchrun's error file
        raise exc
    code = report_error(exc, command="ddpkit", rank=os.environ.get("RANK", "?") if peers else None)
    # torchrun's summary: what failed, no traceback
    write_error_file(f"{type(exc).__name__}: {exc}", when=time.time(), code=code)
    return code


def _has_peers() -> bool:
    """True when this process is one rank of a job of several (torchrun or srun variables)."""
    try:
        return read_dist_env().world_size > 1
    except LaunchError:
        # A broken launch environment: no group was ever formed
        return False


def _exit_now(code: int) -> None:
    """Exit without the interpreter's teardown, after the cleanup that matters.

    Peers blocked in a collective with this rank learn of the failure only when its sockets
    close, i.e. when this process is gone: Gloo's ``destroy_process_group`` (and ``abort``) leave
    the connections open while DDP still references the group. A normal exit waits for every
    non-daemon thread first (a user's uploader or logger thread can keep it alive forever, and
    the peers would then wait for the whole ``dist.timeout``) and spends a second unloading
    libraries. Every ``finally`` block has already run by the time we get here; what is left is
    flushing output and stopping this rank's child processes (DataLoader workers), which the
    interpreter's exit would otherwise do.
    """
    logging.shutdown()
    terminate(code, stop_children=lambda child: child.terminate())
