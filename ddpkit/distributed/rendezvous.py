"""How the ranks meet: the store a new default group is built on, and the one-line error when they cannot.

    store = init_default_group(env, "gloo", timeout=300)   # creates torch's default group; returns its store
    server = loopback_store(0, world_size=2)                # a TCPStore on 127.0.0.1 only, on a free port

The store depends on the launcher (``env.launcher``): none (``python train.py``) gets a private
in-memory store for a group of one; torchrun gets torch's ``env://`` rendezvous, isolated per
restart, or on one node a store that listens on loopback only; SLURM gets a TCPStore on the first
node. :mod:`ddpkit.distributed.process_group` calls this once and owns the group's lifetime.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from contextlib import suppress
from typing import Any

import torch.distributed as dist

from ddpkit.distributed.env import DistEnv
from ddpkit.errors import LaunchError, first_line

__all__ = ["init_default_group", "default_store", "is_loopback", "loopback_store"]


def init_default_group(env: DistEnv, backend: str, timeout: float) -> Any:
    """Create the default group on the store ``env``'s launcher implies; return that store.

    A launch failure (a port in use, a peer that never comes, a refused connection) is a
    :class:`~ddpkit.errors.LaunchError` of one line that names MASTER_ADDR/MASTER_PORT and the fix.
    """
    kwargs: dict[str, Any] = dict(backend=backend, timeout=datetime.timedelta(seconds=timeout))
    try:
        if env.launcher == "none":
            # No launcher, no rendezvous: a private in-memory store makes a group of one.
            kwargs.update(store=dist.HashStore(), rank=0, world_size=1)
        elif env.launcher == "torchrun":
            kwargs.update(_torchrun_store(env, timeout))
        else:
            # SLURM: a TCPStore on the first node, as init_method="tcp://..." would make.
            url = f"tcp://{_host(env.master_addr)}:{env.master_port}?rank={env.rank}&world_size={env.world_size}"
            store, _, _ = next(dist.rendezvous(url, timeout=datetime.timedelta(seconds=timeout)))
            kwargs.update(store=store, rank=env.rank, world_size=env.world_size)
        dist.init_process_group(**kwargs)
    except (RuntimeError, ValueError, OSError) as exc:
        # DistNetworkError and DistStoreError are RuntimeErrors.
        raise _launch_error(env, exc) from None
    return kwargs["store"]


def default_store() -> Any:
    """The store of a group someone else created (e.g. :mod:`ddpkit.testing`), if torch exposes it."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except (ImportError, RuntimeError, ValueError):
        return None


def _torchrun_store(env: DistEnv, timeout: float) -> dict[str, Any]:
    """The store for a torchrun-launched group: torch's env:// rendezvous, isolated per restart.

    Under torchrun the ranks usually join a store served by the elastic agent
    (``TORCHELASTIC_USE_AGENT_STORE=True``), and that store outlives a restart of the worker
    group (pytorch/pytorch#135712). The process group's keys from the failed attempt are still
    there, so a restarted rank can read a dead peer's address and fail to connect. A prefix per
    attempt (``TORCHELASTIC_RESTART_COUNT``) gives every attempt clean keys. (``ddpkit run``
    also asks the c10d rendezvous for a fresh store per round, where restart counts of nodes
    that restarted for different reasons could disagree.)
    """
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    # ``ddpkit run`` on one node: rank 0 serves the store on loopback only.
    if env.rank == 0 and not agent_store and is_loopback(env.master_addr):
        return {
            "store": loopback_store(env.master_port, world_size=env.world_size, timeout=timeout),
            "rank": 0,
            "world_size": env.world_size,
        }
    store, rank, world_size = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=timeout)))
    if agent_store:
        store = dist.PrefixStore(f"ddpkit/attempt_{env.restart_count}", store)
    return {"store": store, "rank": rank, "world_size": world_size}


def is_loopback(addr: str) -> bool:
    """Whether ``addr`` (a MASTER_ADDR) names this machine's loopback interface (127.0.0.0/8, ::1, localhost)."""
    with suppress(ValueError):
        return ipaddress.ip_address(addr.strip("[]")).is_loopback
    return addr == "localhost"


def loopback_store(
    port: int, *, world_size: int | None = None, timeout: float = 300.0, addr: str = "127.0.0.1"
) -> dist.TCPStore:
    """A TCPStore server listening on ``addr`` (loopback) only, on ``port`` (0: a free one): for jobs on one machine.

    torch's TCPStore server listens on every interface, whatever host name it is given; handed a
    socket bound to loopback (``master_listen_fd``) it listens there. Both stores of a one-node
    ``ddpkit run`` come from here: the launcher's rendezvous store (:mod:`ddpkit.launch.torchrun_adapter`)
    and rank 0's (:func:`_torchrun_store`). ``world_size``: wait for that many clients, as torch does.
    """
    with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As torch's own server does: TIME_WAIT leftovers of a restart.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr.strip("[]"), port))
        sock.listen(socket.SOMAXCONN)
        bound = sock.getsockname()[1]
        # The store owns the socket from here.
        fd = sock.detach()
    return dist.TCPStore(
        addr,
        bound,
        world_size,
        True,
        datetime.timedelta(seconds=timeout),
        wait_for_workers=world_size is not None,
        master_listen_fd=fd,
    )


def _host(addr: str) -> str:
    return f"[{addr}]" if ":" in addr else addr


def _launch_error(env: DistEnv, exc: BaseException) -> LaunchError:
    text = str(exc)
    where = f"MASTER_ADDR={env.master_addr} MASTER_PORT={env.master_port}"
    if "EADDRINUSE" in text or "address already in use" in text.lower():
        return LaunchError(
            f"port {env.master_port} is already in use ({where}), probably by another job. "
            "Pick a free one with --master-port=PORT, or use `ddpkit run`, which picks a free port by default."
        )
    if "timed out" in text.lower() or "timeout" in text.lower():
        return LaunchError(
            f"rank {env.rank} could not reach the other {env.world_size - 1} rank(s) at {where} in time. "
            "Check that every node uses the same MASTER_ADDR/MASTER_PORT, that the port is open in the "
            "firewall, and that --nnodes x --nproc-per-node equals the number of processes started."
        )
    return LaunchError(
        f"could not create the process group ({where}, rank {env.rank} of {env.world_size}): {first_line(exc)}"
    )
