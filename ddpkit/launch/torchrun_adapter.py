"""Everything ddpkit's launcher needs from torch's launcher (torchrun) that is not a documented API, in one place.

    args = parse(["--nproc-per-node=2", "--standalone", "-m", "ddpkit", "train", "exp.yaml"])   # torchrun's own parser
    check_passthrough(["--local-ranks-filter", "0"])     # what follows ``ddpkit run ... --``: a typo is a ConfigError
    run(args, fork=False)                                # torch.distributed.run.run(args), or forked workers
    failures(exc)                                        # a ChildFailedError's records, by global rank
    register_loopback_rendezvous()                       # --rdzv-backend=ddpkit-loopback: one node, store on 127.0.0.1
    with observe_faults(listener): run(args, ...)        # each failed attempt: detected, stopped, exit codes

``torchrun`` is ``torch.distributed.run``; ddpkit calls it in-process (:mod:`ddpkit.launch.launcher`).
Its command line is public and stable, but ddpkit also uses pieces of it that are not: the argument
parser's table of option strings (to ask which flags this torch has), ``config_from_args`` (to start
forked workers through ``elastic_launch``), the failure records of ``ChildFailedError`` and the name
of the logger torch's worker polling writes to; and a rendezvous backend of ddpkit's own, registered
the documented way (``rendezvous_handler_registry``), which is torch's c10d rendezvous on a store
listening on loopback only. Each of those is read here and nowhere else, so a
torch release that moves one breaks this module's tests (``tests/test_torchrun_passthrough.py``), not
the launcher's logic. ``pyproject.toml`` requires the torch these were checked against (see there). The polling
of the workers (``PContext.wait``) is observed, to time each fault (:func:`observe_faults`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ddpkit.errors import ConfigError

__all__ = [
    "parse",
    "has_option",
    "check_passthrough",
    "run",
    "failures",
    "process_failure",
    "launcher_exceptions",
    "register_loopback_rendezvous",
    "observe_faults",
    "round_info",
    "POLLING_LOGGER",
    "LOOPBACK_RDZV",
]

#: The logger torch's multiprocessing context writes "failed (exitcode: N)" lines to (with a traceback).
POLLING_LOGGER = "torch.distributed.elastic.multiprocessing.api"

#: The rendezvous backend of a one-node ``ddpkit run`` (see :func:`register_loopback_rendezvous`).
LOOPBACK_RDZV = "ddpkit-loopback"


def launcher_exceptions() -> tuple[type[BaseException], type[BaseException]]:
    """(``SignalException``, ``ChildFailedError``): what ``run`` raises when the agent got a signal, or workers
    failed."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    return SignalException, ChildFailedError


def _parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "torchrun"
    return parser


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """torchrun's parsed arguments for ``argv`` (``torch.distributed.run.parse_args``: its parser, its checks)."""
    from torch.distributed.run import parse_args

    return parse_args(list(argv))


def has_option(option: str) -> bool:
    """Whether this torch's launcher takes ``option`` (its flags grew across the torch releases ddpkit supports)."""
    # Private: the parser's table of option strings
    return option in _parser()._option_string_actions


class _Refused(Exception):
    pass


def check_passthrough(options: Sequence[str]) -> list[str]:
    """``options`` (what follows ``--`` on ``ddpkit run``), unchanged, once torchrun's own parser accepts them.

    Raises a ConfigError (exit code 2) with torchrun's message for an option torchrun does not know or a
    value it refuses, before anything starts; a program or a positional argument there is refused too
    (ddpkit names the program: the config's trainer, or ``--script``).
    """
    options = list(options)
    parser = _parser()

    def refuse(message: str) -> None:
        raise _Refused(message)

    # argparse would print the usage and exit
    parser.error = refuse  # type: ignore[method-assign]
    try:
        parsed = parser.parse_args([*options, "PROGRAM"])
    except _Refused as exc:
        raise ConfigError(f"after `--` (torchrun's options): torchrun: error: {exc}; see `torchrun --help`") from None
    if parsed.training_script != "PROGRAM" or parsed.training_script_args:
        raise ConfigError(
            f"after `--` (torchrun's options): {parsed.training_script!r} is not a torchrun option; only options go "
            "after `--` (e.g. -- --local-ranks-filter 0); the program is the config's Trainer or --script"
        )
    return options


def run(args: argparse.Namespace, *, fork: bool, entrypoint: Any = None, before_fork: Any = None) -> None:
    """``torch.distributed.run.run(args)``; with ``fork``, the workers are ``entrypoint(program)`` in processes
    forked from this one.

    ``before_fork(program)`` runs in this process just before (what the forked workers should inherit).
    """
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args
    from torch.distributed.run import run as torchrun

    if not fork:
        torchrun(args)
        return
    # What torchrun's run() does for --standalone: c10d rendezvous on a free local port
    if args.standalone:
        args.rdzv_backend = "c10d"
        args.rdzv_endpoint = "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    # Not public API: torchrun's own translation of its options
    config, _, _ = config_from_args(args)
    config.start_method = "fork"
    # what `python -u` would run
    program = [*(["-m"] if args.module else []), args.training_script, *args.training_script_args]
    if before_fork is not None:
        before_fork(program)
    elastic_launch(config=config, entrypoint=entrypoint)(program)


def _loopback_handler(params: Any) -> Any:
    """The one-node rendezvous (:class:`ddpkit.launch.one_node_rendezvous.OneNodeRendezvous`), on a TCPStore that
    this process hosts on loopback only (``--rdzv-endpoint``'s port, 0: a free one)."""
    from ddpkit.distributed.rendezvous import loopback_store
    from ddpkit.launch.one_node_rendezvous import OneNodeRendezvous

    host, _, port = params.endpoint.rpartition(":")
    timeout = float(params.get_as_int("read_timeout", 60) or 60)
    store = loopback_store(int(port or 0), timeout=timeout, addr=host or "127.0.0.1")
    # torch's launcher checks that the handler's backend has the name it asked for
    return OneNodeRendezvous(
        store, run_id=params.run_id, backend=LOOPBACK_RDZV, info=round_info, local_addr=params.local_addr or host
    )


def round_info(store: Any, local_addr: str) -> Any:
    """torch's ``RendezvousInfo`` of a one-node round: rank 0 of 1 on ``store``; the workers' store on a free port
    of ``local_addr`` (``RendezvousStoreInfo.build``, as torch's handlers do with their store unshared)."""
    from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousStoreInfo

    return RendezvousInfo(store, 0, 1, RendezvousStoreInfo.build(0, store, local_addr=local_addr))


def register_loopback_rendezvous() -> None:
    """Make ``--rdzv-backend=ddpkit-loopback`` known to torch's launcher in this process: a one-node job's
    rendezvous, on a store listening on loopback only, that completes each round at once (``--standalone``'s
    would listen on every interface and sleep up to 0.3 s on the first restart)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    # The same creator again is a no-op
    rendezvous_handler_registry.register(LOOPBACK_RDZV, _loopback_handler)


#: ``listener(detected=, stopped=, attempt=, codes=)``: the agent saw a worker of ``attempt`` fail at
#: ``detected`` and every worker of it was gone at ``stopped``; ``codes``: local rank -> exit code (-N: signal N).
FaultListener = Callable[..., None]


@contextlib.contextmanager
def observe_faults(listener: FaultListener) -> Iterator[None]:
    """Tell ``listener`` of each failed attempt the agent of this process sees, while the block runs.

    The agent's monitor polls its workers (``PContext.wait(0)``, every ``--monitor-interval``); the poll that
    sees a failure also stops the other workers (SIGTERM, then SIGKILL after a grace period) before it returns.
    So the poll's start is when the failure was detected, and its return when the attempt's last worker was
    gone. Not public API: torch's ``PContext.wait`` is wrapped here, in this process only, and restored after.
    """
    from torch.distributed.elastic.multiprocessing.api import PContext

    original = PContext.wait

    def wait(self: Any, timeout: float = -1, period: float = 1) -> Any:
        began = time.time()
        result = original(self, timeout, period)
        if result is not None and result.is_failed():
            # A record of the fault must never stop the agent's restart
            try:
                attempt = int(self.envs[0].get("TORCHELASTIC_RESTART_COUNT", 0)) if self.envs else 0
                listener(detected=began, stopped=time.time(), attempt=attempt, codes=_exit_codes(self, result))
            except Exception as exc:  # noqa: BLE001
                logging.getLogger(__name__).debug("fault not recorded: %s", exc)
        return result

    PContext.wait = wait  # type: ignore[method-assign]
    try:
        yield
    finally:
        PContext.wait = original  # type: ignore[method-assign]


def _exit_codes(pcontext: Any, result: Any) -> dict[int, int]:
    """Each worker's exit code once stopped: forked (``_pc.processes``) or new interpreters
    (``subprocess_handlers``)."""
    codes = {rank: failure.exitcode for rank, failure in result.failures.items()}
    processes = getattr(getattr(pcontext, "_pc", None), "processes", None)
    if processes is not None:
        codes.update({rank: p.exitcode for rank, p in enumerate(processes) if p.exitcode is not None})
    for rank, handler in getattr(pcontext, "subprocess_handlers", {}).items():
        if handler.proc.poll() is not None:
            codes[rank] = handler.proc.returncode
    return dict(sorted(codes.items()))


def failures(exc: Any) -> dict[int, Any]:
    """The per-rank failure records of a ``ChildFailedError`` (global rank -> ``ProcessFailure``), which callers may
    add to."""
    return exc.failures


def process_failure(*, local_rank: int, pid: int, exitcode: int, error_file: str) -> Any:
    """A failure record like the ones torch's launcher makes, for a failure it did not observe."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    return ProcessFailure(local_rank=local_rank, pid=pid, exitcode=exitcode, error_file=error_file)
