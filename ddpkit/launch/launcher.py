"""The launcher side of a launch: check preconditions once, build torchrun's argv, start the workers.

    preflight(nproc="2", backend="auto", device="auto", precision="fp32")   # refuse what every worker would
    argv = torchrun_argv(nproc="2", program=["-m", "ddpkit", "train", "exp.yaml"], extra=["--local-ranks-filter", "0"])
    code = launch(argv, requeue_exit_code=75)

``launch`` is ``torchrun`` called in-process (``torch.distributed.run``): ddpkit never starts or
supervises workers itself. With ``fork=True`` torch's launcher forks the workers from this process
instead of starting new interpreters (``start_method="fork"``, :mod:`ddpkit.launch.forked`).
It adds the defaults ddpkit relies on (one OpenMP thread per worker, a fresh rendezvous store per
restart) and a failure summary whose "Root Cause" is the rank that failed first. A one-node job
listens on loopback only (:func:`torchrun_argv`) and every job gets a secret of its own for the tags
on its control messages (:mod:`ddpkit.distributed.control_auth`). Used by
``ddpkit run`` and ``ddpkit bench``; the worker side is :mod:`ddpkit.launch.entrypoint`. What this
needs from torch's launcher beyond its command line is in :mod:`ddpkit.launch.torchrun_adapter`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ddpkit.distributed.control_auth import SECRET_ENV, new_secret
from ddpkit.errors import (
    EXIT_CONFIG,
    EXIT_FAILURE,
    EXIT_HANG,
    EXIT_OK,
    EXIT_PREEMPTED,
    EXIT_UNHEALTHY,
    ConfigError,
    LaunchError,
    exit_now,
)
from ddpkit.launch import torchrun_adapter

__all__ = ["launch", "preflight", "torchrun_argv", "default_nproc", "check_port_free", "exit_at_once"]


def preflight(
    *,
    nproc: str,
    backend: str = "auto",
    device: str = "auto",
    precision: str = "fp32",
    precision_option: str = "train.precision=",
) -> str | None:
    """Refuse here, once, what every worker would refuse: NCCL without CUDA, more processes than
    GPUs, fp16 on the CPU. The checks are the workers' own functions, run for the last local rank.
    Returns the workers' device type (``"cpu"``, ``"cuda"``), or None when torchrun counts the devices."""
    from ddpkit.distributed.env import DistEnv
    from ddpkit.distributed.process_group import resolve_backend, resolve_device
    from ddpkit.training.precision import check_precision

    # torchrun's "gpu", "cpu", "auto" count the devices themselves
    if not nproc.isdigit():
        return None
    n = int(nproc)
    # The last rank needs the most GPUs
    last = DistEnv(rank=n - 1, local_rank=n - 1, world_size=n, local_world_size=n)
    try:
        torch_device = resolve_device(last, device)
    except LaunchError as exc:
        # More processes than GPUs: a refused launch, which a retry will not fix (exit 2)
        raise ConfigError(str(exc)) from None
    resolve_backend(backend, torch_device)
    check_precision(precision, torch_device, option=precision_option)
    return torch_device.type


def default_nproc() -> int:
    """Processes per node when none are asked for: one per GPU, or 1 on the CPU."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def torchrun_argv(
    *,
    nproc: str,
    program: Sequence[str],
    nnodes: str = "1",
    max_restarts: int = 0,
    shutdown_timeout: float = 10.0,
    node_rank: int = 0,
    master_addr: str | None = None,
    master_port: int | None = None,
    rdzv_endpoint: str | None = None,
    rdzv_id: str = "ddpkit",
    forward_signals: Sequence[str] = (),
    extra: Sequence[str] = (),
) -> list[str]:
    """torchrun's argument list: on one node, loopback only (:func:`_loopback_rendezvous`); static or c10d
    rendezvous otherwise.

    ``shutdown_timeout`` is how long torchrun's agent waits for workers to exit after it
    forwards a signal before it sends SIGKILL. ``forward_signals`` are forwarded to the workers
    too, besides torchrun's own SIGTERM, SIGINT, SIGHUP and SIGQUIT (e.g. SLURM's SIGUSR1).
    ``extra``: torchrun options given as they are (``ddpkit run CONFIG -- OPTIONS``), checked by
    torchrun's own parser (a ConfigError with its message otherwise) and placed after ddpkit's own,
    so that one given twice is the user's.
    """
    argv = [
        f"--nproc-per-node={nproc}",
        f"--nnodes={nnodes}",
        f"--max-restarts={max_restarts}",
        f"--monitor-interval={MONITOR_INTERVAL}",
    ]
    extra = torchrun_adapter.check_passthrough(extra) if extra else []
    # Not in torch 2.11 and older, whose agent waits a fixed 30 s
    if torchrun_adapter.has_option("--shutdown-timeout"):
        argv.append(f"--shutdown-timeout={max(1, math.ceil(shutdown_timeout))}")
    signals = [name for name in forward_signals if name not in _TORCHRUN_SIGNALS]
    # Newer than torch 2.6
    if signals and torchrun_adapter.has_option("--signals-to-handle"):
        argv.append(f"--signals-to-handle={','.join([*_TORCHRUN_SIGNALS, *signals])}")
    if rdzv_endpoint:
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={rdzv_id}"]
    elif nnodes in ("1", "1:1") and master_addr is None:
        argv += _loopback_rendezvous(master_port)
    else:
        addr = master_addr or "127.0.0.1"
        port = master_port if master_port is not None else 29500
        if node_rank == 0:
            check_port_free(addr, port)
        argv += [f"--master-addr={addr}", f"--master-port={port}", f"--node-rank={node_rank}"]
    return [*argv, *extra, *program]


#: How often torch's agent polls its workers, in seconds (torchrun's default: 0.1). A fault is seen 10 ms after
#: it on average instead of 50; a poll is a ``select`` on the workers' pipes, about 1% of one core at this rate.
MONITOR_INTERVAL = 0.02


def _loopback_rendezvous(port: int | None) -> list[str]:
    """One node (``nnodes`` 1, no ``master_addr``, no ``rdzv_endpoint``): torch's c10d rendezvous (``--standalone``'s)
    on a store listening on 127.0.0.1 (a free port, or ``port``); ``--local-addr`` makes the workers' MASTER_ADDR
    127.0.0.1, where rank 0's store then listens too (:func:`ddpkit.distributed.rendezvous.loopback_store`).
    Several nodes listen on every interface: docs/multinode.md, "Open ports"."""
    if port is not None:
        check_port_free("127.0.0.1", port)
    return [
        f"--rdzv-backend={torchrun_adapter.LOOPBACK_RDZV}",
        f"--rdzv-endpoint=127.0.0.1:{port or 0}",
        f"--rdzv-id={uuid.uuid4()}",
        "--local-addr=127.0.0.1",
    ]


def launch(torchrun_argv: list[str], *, fork: bool = False, requeue_exit_code: int = EXIT_PREEMPTED) -> int:
    """Run torch's launcher with ``torchrun_argv``; return its exit code (``ddpkit.errors.EXIT_*``).

    0 when every worker succeeded; ``requeue_exit_code`` (``run.requeue_exit_code``, 75 by default)
    when they stopped on a signal after saving; else the root cause's code (2, 3 or 4, see
    :func:`_root_cause_code`) or 1, with torchrun's failure summary printed.

    ``fork``: torch's launcher starts each worker as a process forked from this one, with torch and
    ddpkit imported here once (:mod:`ddpkit.launch.forked`), instead of a new interpreter: about 2 s
    less per worker start, on every restart. CPU workers only (the caller decides).
    """
    SignalException, ChildFailedError = torchrun_adapter.launcher_exceptions()  # noqa: N806
    args = torchrun_adapter.parse(torchrun_argv)
    _prepare_environment(args)
    try:
        with _fault_log(requeue_exit_code):
            _run(args, fork=fork and hasattr(os, "fork"))
    except SignalException as exc:
        # The agent forwarded it to the workers and waited for them
        print(
            f"ddpkit run: stopped by {signal.Signals(exc.sigval).name}: the workers were asked to save the step they "
            f"agree on (checkpoint.save_on_signals) and exit. Run the same command again to resume.",
            file=sys.stderr,
        )
        return requeue_exit_code
    except ChildFailedError as exc:
        _add_unobserved_failures(exc)
        if _stopped_after_saving(exc, requeue_exit_code):
            print(
                "ddpkit run: the workers stopped on a signal after saving; run the same command again to resume.",
                file=sys.stderr,
            )
            return requeue_exit_code
        print(f"ddpkit run: the training job failed.\n{_summary(exc)}", file=sys.stderr)
        return _root_cause_code(exc)
    return EXIT_OK


def _prepare_environment(args: Any) -> None:
    """What the launcher and its workers share through the environment, set before torch's launcher starts."""
    # torchrun would set this too (with a banner) for several processes per node: one thread
    # per process keeps N processes from oversubscribing the cores.
    if "OMP_NUM_THREADS" not in os.environ and args.nproc_per_node not in ("1", 1):
        os.environ["OMP_NUM_THREADS"] = "1"
    # A fresh rendezvous store per round: the shared one keeps a failed attempt's keys, which
    # can point restarted ranks at dead peers (pytorch/pytorch#135712; see ddpkit.distributed.rendezvous).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # The tags on the job's control messages: the workers inherit it (torchrun passes its environment on).
    os.environ[SECRET_ENV] = os.environ.get(SECRET_ENV) or new_secret()
    if args.rdzv_backend == torchrun_adapter.LOOPBACK_RDZV:
        _loopback_only()


def _loopback_only() -> None:
    """A one-node job: the rendezvous backend that listens on loopback, and Gloo's and NCCL's sockets
    on the loopback interface too (they would take the host name's address), unless the user chose one."""
    torchrun_adapter.register_loopback_rendezvous()
    # A shared store would be torch's, on every interface
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    names = [name for _, name in socket.if_nameindex()] if hasattr(socket, "if_nameindex") else []
    loopback = next((name for name in names if name.startswith("lo")), None)
    if loopback is not None:
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(name, loopback)


def _fault_log(requeue_exit_code: int) -> contextlib.AbstractContextManager:
    """Each failed attempt the agent sees, timed, into the run's ``goodput.jsonl`` (``ddpkit goodput``'s faults),
    when ``ddpkit run`` named the run's directory (:data:`ddpkit.goodput.ledger.GOODPUT_DIR_ENV`)."""
    from ddpkit.goodput.ledger import GOODPUT_DIR_ENV

    output_dir = os.environ.get(GOODPUT_DIR_ENV)
    if not output_dir:
        return contextlib.nullcontext()
    from ddpkit.goodput.faults import fault_recorder

    return torchrun_adapter.observe_faults(fault_recorder(output_dir, requeue_exit_code=requeue_exit_code))


def _run(args: Any, *, fork: bool) -> None:
    """``torch.distributed.run.run(args)``, with the workers forked from this process when ``fork``."""
    if not fork:
        torchrun_adapter.run(args, fork=False)
        return
    from ddpkit.launch.forked import preload, quiet_polling_tracebacks, run_program

    torchrun_adapter.run(
        args,
        fork=True,
        entrypoint=run_program,
        before_fork=lambda program: (preload(program), quiet_polling_tracebacks()),
    )


def _stopped_after_saving(exc: Any, requeue_exit_code: int = EXIT_PREEMPTED) -> bool:
    """Whether the workers stopped on a signal with the step saved: some exited ``requeue_exit_code``
    (``run.requeue_exit_code``, 75 by default), the rest were ended by the agent.

    A worker exits with it only after the barrier that follows the save, so the save was complete on
    every rank by then; the agent, seeing the first one leave, stops the others (SIGTERM, then
    SIGKILL) while they are leaving too. A rank that failed any other way makes it a failure.
    """
    codes = [failure.exitcode for failure in torchrun_adapter.failures(exc).values()]
    expected = (requeue_exit_code, -signal.SIGTERM, -signal.SIGKILL)
    return requeue_exit_code in codes and all(code in expected for code in codes)


def _add_unobserved_failures(exc: Any) -> None:
    """Add the failures torch's launcher did not observe, from the ranks' error files.

    With forked workers (``fork=True``) torch's multiprocess context reports only the first worker
    it sees exit: when a rank fails and the ranks waiting for it fail moments later, it may name
    one of those. Each rank's error file lies in ``attempt_N/<local_rank>/``; ddpkit records the
    exit code and pid in the ones it writes (1 for a traceback torch recorded). With new
    interpreters torch reports every failure and this adds nothing.
    """
    recorded = torchrun_adapter.failures(exc)
    for rank, failure in list(recorded.items()):
        path = Path(failure.error_file)
        if path.parent.name != str(failure.local_rank) or not path.parent.parent.is_dir():
            continue
        known = {f.local_rank for f in recorded.values()}
        for other in sorted(path.parent.parent.iterdir(), key=lambda p: p.name):
            local = other.name
            file = other / path.name
            if local.isdigit() and int(local) not in known and file.is_file():
                info = _extra_info(file)
                code = int(info.get("exitcode", EXIT_FAILURE))
                recorded[rank - failure.local_rank + int(local)] = torchrun_adapter.process_failure(
                    local_rank=int(local), pid=int(info.get("pid", 0)), exitcode=code, error_file=str(file)
                )


def _extra_info(error_file: Path) -> dict[str, Any]:
    try:
        return json.loads(error_file.read_text())["message"]["extraInfo"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _root_cause_code(exc: Any) -> int:
    """The first failed rank's exit code when it tells a scheduler what to do (2: fix the config, 3: a hang,
    4: unhealthy; ``ddpkit.errors.EXIT_CODES``), else 1."""
    _, first = exc.get_first_failure()
    code = _code_it_stands_for(first)
    return code if code in (EXIT_CONFIG, EXIT_HANG, EXIT_UNHEALTHY) else EXIT_FAILURE


def _code_it_stands_for(failure: Any) -> int:
    """A failed rank's exit code; for a frozen rank the watchdog SIGKILLed, the code its error file records (3)."""
    code = failure.exitcode
    if code == -signal.SIGKILL:
        message = (getattr(failure, "error_file_data", None) or {}).get("message")
        code = message.get("extraInfo", {}).get("exitcode", code) if isinstance(message, dict) else code
    return code


#: What torchrun's agent handles (and forwards to the workers) by default.
_TORCHRUN_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")

# How a rank's error reads when it only saw another rank go (Gloo, NCCL).
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "remote process exited")


def _summary(exc: Any) -> str:
    """torchrun's failure summary, with the rank that failed first as its "Root Cause".

    torchrun picks the failure with the earliest error-file timestamp, in whole seconds. The
    ranks that were waiting for the failing one in a collective fail a few milliseconds later,
    usually within the same second, and the tie goes to the lowest rank: rank 0's "Connection
    closed by peer" would be named as the cause. Failures that only report a lost peer, or a
    SIGTERM from the agent stopping the group, are moved back a second so the tie goes to the
    real one (if all failures are of that kind, their order is unchanged). A frozen rank the watchdog
    killed shows the code it stands for (3), as when torch did not see it exit.
    """
    for failure in torchrun_adapter.failures(exc).values():
        # A frozen rank reads the same whether torch saw the watchdog's SIGKILL or ddpkit added it from its error file
        failure.exitcode = _code_it_stands_for(failure)
        if failure.exitcode == -signal.SIGTERM or any(text in str(failure.message) for text in _PEER_LOST):
            failure.timestamp += 1
    return exc.format_msg()


def check_port_free(addr: str, port: int) -> None:
    """Raise a LaunchError if ``port`` cannot be bound on this machine."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))
        except OSError:
            raise LaunchError(
                f"--master-port {port} is already in use on this machine (another job?). "
                "Pick another with --master-port=PORT, or leave --master-port out to get a free one."
            ) from None


def exit_at_once(code: int) -> None:
    """End the launcher process with ``code`` once the workers are gone, skipping the interpreter's
    teardown of torch (3 to 15 s measured on the busy 2-core machine, paid at the end of every run:
    docs/goodput.md, "shutdown"). Exit handlers still run and output is flushed; nothing else is left."""
    import atexit
    import logging

    atexit._run_exitfuncs()
    logging.shutdown()
    exit_now(code)
