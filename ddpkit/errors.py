"""The exceptions ddpkit raises for problems a user can cause and fix.

Every message names what is wrong (the config key, file, value or rank) and says what to do.
The command line turns these into a one-paragraph message and a non-zero exit code instead of a
traceback; internal invariants use ``assert`` and are bugs, not user errors.

    raise ConfigError("optim.lr: expected a value > 0, got -1; set optim.lr to a positive number")
    sys.exit(exit_code_of(lambda: command(args), command="ddpkit plot"))   # 0, or the error's code

The process exit codes are defined here, once (every command, worker and launcher uses them):
``EXIT_OK`` 0, ``EXIT_FAILURE`` 1, ``EXIT_CONFIG`` 2, ``EXIT_HANG`` 3, ``EXIT_UNHEALTHY`` 4,
``EXIT_PREEMPTED`` 75 (``run.requeue_exit_code``), ``EXIT_INTERRUPTED`` 130. :data:`EXIT_CODES` is the
contract a scheduler reads them by (README, ``ddpkit run --help``, docs/multinode.md): retry 1 and 3,
fail for good on 2 and 4, requeue on 75.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import NoReturn

__all__ = [
    "EXIT_OK",
    "EXIT_FAILURE",
    "EXIT_CONFIG",
    "EXIT_HANG",
    "EXIT_UNHEALTHY",
    "EXIT_PREEMPTED",
    "EXIT_INTERRUPTED",
    "EXIT_CODES",
    "NO_RETRY",
    "exit_code_table",
    "check_requeue_exit_code",
    "report_error",
    "exit_code_of",
    "exit_now",
    "first_line",
    "DdpkitError",
    "ConfigError",
    "LaunchError",
    "DataError",
    "CheckpointError",
    "ConsistencyError",
    "HealthError",
]

EXIT_OK = 0
#: A run or launch failed: a DdpkitError other than a config error, a crash, or a rank stopped because a peer failed.
EXIT_FAILURE = 1
#: The config (or the command line's usage) is invalid: fix it and run again; argparse uses 2 too.
EXIT_CONFIG = 2
#: The hang watchdog stopped the job after ``dist.hang_timeout`` without progress (see logs/hang-*.txt).
EXIT_HANG = 3
#: Training went unhealthy and ``health`` says stop (non-finite steps, too many skips, diverged replicas):
#: a resume from the newest checkpoint would most likely repeat it, so a scheduler should not retry.
EXIT_UNHEALTHY = 4
#: Stopped by a signal after saving the step every rank agreed on: run the same command again to resume.
#: 75 is sysexits.h's EX_TEMPFAIL ("try again later"), the code schedulers read as "requeue me". The
#: default of ``run.requeue_exit_code``, which a cluster whose retry rules want another code sets.
EXIT_PREEMPTED = 75
#: Ctrl-C (128 + SIGINT, as shells report it).
EXIT_INTERRUPTED = 130

#: The exit-code contract, one row per code: (code, what happened, what a scheduler should do).
EXIT_CODES: tuple[tuple[int, str, str], ...] = (
    (EXIT_OK, "success", "done"),
    (EXIT_FAILURE, "failed: a crash, a lost peer, I/O", "retry (resumes)"),
    (EXIT_CONFIG, "refused: invalid config, data, usage or launch", "fail: fix it"),
    (EXIT_HANG, "the hang watchdog stopped the job", "retry (resumes)"),
    (EXIT_UNHEALTHY, "unhealthy: NaN/Inf steps, diverged replicas", "fail: would repeat"),
    (EXIT_PREEMPTED, "stopped by a signal after saving", "requeue (resumes)"),
    (EXIT_INTERRUPTED, "interrupted with Ctrl-C", "stop"),
)
#: The codes a retry will not fix: a scheduler should fail the job on these.
NO_RETRY = frozenset({EXIT_CONFIG, EXIT_UNHEALTHY, EXIT_INTERRUPTED})


def exit_code_table(*, requeue: int = EXIT_PREEMPTED, indent: str = "    ") -> str:
    """:data:`EXIT_CODES` as aligned text (``ddpkit run --help``), with ``requeue`` in the requeue row."""
    rows = [(requeue if code == EXIT_PREEMPTED else code, what, action) for code, what, action in EXIT_CODES]
    width = max(len(what) for _, what, _ in rows)
    return "\n".join(f"{indent}{code:<5}{what:<{width}}  {action}" for code, what, action in rows)


def check_requeue_exit_code(code: int) -> int:
    """``run.requeue_exit_code``, checked: 1 to 255 and none of the table's other codes; else a ConfigError."""
    taken = {c for c, _, _ in EXIT_CODES if c != EXIT_PREEMPTED}
    if not 1 <= code <= 255 or code in taken:
        raise ConfigError(
            f"run.requeue_exit_code: {code} cannot mean 'saved, please requeue': an exit code is 1 to 255 and "
            f"{sorted(taken)} mean something else (ddpkit run --help); use 75 (the default) or, for Kubeflow's "
            "restartPolicy: ExitCode, a code of 128 or more such as 138"
        )
    return code


class DdpkitError(Exception):
    """Base class: a problem with the user's input or environment, with a message saying how to fix it."""

    #: Process exit code used by the command line for this kind of error.
    exit_code = EXIT_FAILURE
    #: How the one-line report names it: ``ddpkit run: error: ...`` (``stopped`` for a preemption).
    label = "error"
    #: Set once :func:`report_error` has printed it, so a later report only returns the exit code.
    reported = False


class ConfigError(DdpkitError, ValueError):
    """The YAML file, a ``key=value`` override or a config value is invalid."""

    exit_code = EXIT_CONFIG


class LaunchError(DdpkitError):
    """The processes cannot form a group: bad launcher variables, ports, backends or devices."""


class DataError(DdpkitError):
    """A dataset cannot be found, is not what the config says, or is too small for the world size and batch size.

    Exit 2 like a config error: the same data fails the same way on a retry (a token id outside the
    vocabulary, a file of the wrong size), so a scheduler should not retry it. ``retryable=True``
    (exit 1) is for what a retry may not meet again: a file that changed under the running job, a
    peer that never wrote its part.
    """

    exit_code = EXIT_CONFIG

    def __init__(self, message: str, *, retryable: bool = False):
        super().__init__(message)
        if retryable:
            self.exit_code = EXIT_FAILURE


class CheckpointError(DdpkitError):
    """A checkpoint is missing, corrupt, unsafe to load, or belongs to a different run."""


class ConsistencyError(DdpkitError):
    """Ranks disagree on something that must be identical (config, model, data, versions)."""


class HealthError(DdpkitError):
    """Training went unhealthy and ``health`` says stop: non-finite steps, too many skips, diverged replicas."""

    exit_code = EXIT_UNHEALTHY


def report_error(exc: DdpkitError, *, command: str, rank: int | str | None = None) -> int:
    """Print ``exc`` as one clear line on stderr (``ddpkit run: error: ...``); return its exit code.

    The one place a user error becomes what a user sees: every command and every worker uses it.
    ``rank`` is named when the process is one rank of several.
    """
    if not exc.reported:
        where = f" (rank {rank})" if rank is not None else ""
        print(f"{command}: {exc.label}{where}: {exc}", file=sys.stderr, flush=True)
        exc.reported = True
    return exc.exit_code


def exit_code_of(run: Callable[[], int], *, command: str) -> int:
    """``run()``'s exit code, with a DdpkitError reported as above and Ctrl-C as :data:`EXIT_INTERRUPTED` (130).

    Args:
        run: the command; returns its exit code (:data:`EXIT_OK` on success).
        command: how the one-line error report names the command, e.g. ``"ddpkit plot"``.
    """
    try:
        return run()
    except DdpkitError as exc:
        return report_error(exc, command=command)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


#: How much of an exception's first line a log line or a one-line error quotes.
FIRST_LINE_LIMIT = 300


def first_line(exc: BaseException) -> str:
    """The first non-blank line of ``str(exc)``, stripped and cut at 300 characters; the type's name if blank.

    How a one-line report quotes an error it did not write (a tracker's client, a store, a backend),
    whose message can be a multi-line dump:

        first_line(RuntimeError("connect() failed\n  at tcp.cpp:42"))   # -> "connect() failed"
    """
    for line in str(exc).splitlines():
        if line.strip():
            return line.strip()[:FIRST_LINE_LIMIT]
    return type(exc).__name__


def exit_now(code: int) -> NoReturn:
    """Flush stdout and stderr, then end the process with ``code`` without the interpreter's teardown
    (which can wait on threads that never end, or take seconds tearing down torch)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
