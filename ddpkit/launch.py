"""Starting worker processes through torch's own launcher, and reporting how they ended.

    code = launch(["--standalone", "--nproc-per-node=2", "-m", "ddpkit", "train", "exp.yaml"])

``launch`` is ``torchrun`` called in-process (``torch.distributed.run``): ddpkit never starts or
supervises workers itself. It adds the defaults ddpkit relies on (one OpenMP thread per worker,
a fresh rendezvous store per restart) and a failure summary whose "Root Cause" is the rank that
failed first. Used by ``ddpkit run`` and ``ddpkit bench``.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from typing import TYPE_CHECKING

from ddpkit.errors import LaunchError

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

__all__ = ["launch", "check_port_free"]


def launch(torchrun_argv: list[str]) -> int:
    """Run torch's launcher with ``torchrun_argv``; return 0, or 1 with torchrun's failure summary printed."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(torchrun_argv)
    # torchrun would set this too (with a banner) for several processes per node: one thread
    # per process keeps N processes from oversubscribing the cores.
    if "OMP_NUM_THREADS" not in os.environ and args.nproc_per_node not in ("1", 1):
        os.environ["OMP_NUM_THREADS"] = "1"
    # A fresh rendezvous store per round: the shared one keeps a failed attempt's keys, which
    # can point restarted ranks at dead peers (pytorch/pytorch#135712; see ddpkit.distributed).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    try:
        run(args)
    except ChildFailedError as exc:
        print(f"ddpkit run: the training job failed.\n{_summary(exc)}", file=sys.stderr)
        return 1
    return 0


# How a rank's error reads when it only saw another rank go (Gloo, NCCL).
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "remote process exited")


def _summary(exc: ChildFailedError) -> str:
    """torchrun's failure summary, with the rank that failed first as its "Root Cause".

    torchrun picks the failure with the earliest error-file timestamp, in whole seconds. The
    ranks that were waiting for the failing one in a collective fail a few milliseconds later,
    usually within the same second, and the tie goes to the lowest rank: rank 0's "Connection
    closed by peer" would be named as the cause. Failures that only report a lost peer, or a
    SIGTERM from the agent stopping the group, are moved back a second so the tie goes to the
    real one (if all failures are of that kind, their order is unchanged).
    """
    for failure in exc.failures.values():
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
