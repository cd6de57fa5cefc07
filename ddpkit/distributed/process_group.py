"""Process-group setup and teardown, backend and device choice, and small collective helpers.

    env = read_dist_env()
    with process_group(env, backend="auto", device="auto", timeout=300) as runtime:
        ...  # runtime.device, runtime.backend; collectives work, also at world size 1

A world of one (``python train.py``) still gets a real, single-member Gloo/NCCL group backed by an
in-memory store, so the training loop has exactly one code path. Every helper here is also safe
when no group exists at all (it then acts on this process only).
"""

from __future__ import annotations

import datetime
import gc
import importlib
import ipaddress
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.distributed.env import DistEnv
from ddpkit.errors import ConfigError, LaunchError, first_line

__all__ = [
    "Runtime",
    "process_group",
    "group_options",
    "flight_recorder_env",
    "resolve_device",
    "resolve_backend",
    "loopback_store",
    "is_loopback",
    "barrier",
    "all_reduce_sum",
    "all_gather_object",
    "broadcast_object",
]


@dataclass(frozen=True)
class Runtime:
    """What process-group setup resolved: where this rank sits, its device and the backend in use."""

    env: DistEnv
    device: torch.device
    backend: str
    #: Whether ``debug`` mode is on (monitored barriers, per-rank step logs).
    debug: bool = False
    #: The key-value store every rank of the group shares (torchrun's TCPStore, a FileStore,
    #: or an in-memory one for a world of one), or None if it cannot be found. ddpkit's
    #: background coordination (stop requests, heartbeats) uses it under its own key prefix,
    #: never with a collective. Use only non-blocking calls (``set``, ``add``, ``check``)
    #: from other threads: a blocking ``get`` of a missing key would hold the client's lock.
    store: Any = None


def resolve_device(env: DistEnv, requested: str = "auto") -> torch.device:
    """``cuda:LOCAL_RANK`` when CUDA is requested or available (``auto``), else the CPU."""
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("dist.device=cuda but torch.cuda.is_available() is False; use dist.device=auto or cpu")
    visible = torch.cuda.device_count()
    if env.local_rank >= visible:
        raise LaunchError(
            f"LOCAL_RANK={env.local_rank} has no GPU: only {visible} visible on this node "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}). "
            f"Use --nproc-per-node={visible} or fewer."
        )
    return torch.device("cuda", env.local_rank)


def resolve_backend(requested: str, device: torch.device) -> str:
    """``auto``: NCCL for CUDA devices, Gloo for the CPU. ``nccl`` without CUDA is an error."""
    if requested == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if requested == "nccl" and device.type != "cuda":
        raise ConfigError(
            "dist.backend=nccl needs CUDA GPUs, but this run is on the CPU "
            f"(torch.cuda.is_available() is {torch.cuda.is_available()}); use dist.backend=gloo or auto"
        )
    return requested


@contextmanager
def process_group(
    env: DistEnv,
    *,
    backend: str = "auto",
    device: str = "auto",
    timeout: float = 300.0,
    debug: bool = False,
    trace_dir: str | os.PathLike | None = None,
    preload: tuple[str, ...] = (),
) -> Iterator[Runtime]:
    """Create the default process group for ``env`` and always destroy it on exit.

    ``preload`` names torch modules to import before the group exists (see :func:`group_options`).

    With ``trace_dir`` on CUDA, NCCL's flight recorder is on and dumps there on a timeout (see
    :func:`flight_recorder_env`).

    A group that already exists is adopted and left alone on exit, never destroyed: one created by
    :mod:`ddpkit.testing`, by Ray Train's ``TorchTrainer`` (which destroys it itself), or by the user's
    own ``init_process_group`` before building the Trainer. Its rank and world size must be the
    environment's (:func:`ddpkit.distributed.env.read_dist_env` reads them from the group when no
    launcher variable is set).
    """
    torch_device = resolve_device(env, device)
    backend = resolve_backend(backend, torch_device)
    _prepare_process(torch_device, debug=debug, trace_dir=trace_dir, preload=preload)
    created = not dist.is_initialized()
    store = _init(env, backend, timeout) if created else _existing_group_store(env)
    try:
        yield Runtime(env=env, device=torch_device, backend=dist.get_backend(), debug=debug, store=store)
    except BaseException:
        if created and dist.is_initialized():
            dist.destroy_process_group()  # the process exits next (see ddpkit.launch.entrypoint)
        raise
    if created and dist.is_initialized():
        _destroy()


def _destroy() -> None:
    """Destroy the default group after a success so that its backend goes now, threads joined.

    The group's C++ backend lives as long as anything references it. Left to interpreter
    shutdown, a Gloo worker thread that finishes a collective then drops the last reference to a
    tensor Python created and needs the GIL for it, which a finalizing interpreter answers with
    ``pthread_exit``: through C++'s noexcept frames that is ``std::terminate`` ("terminate called
    without an active exception", SIGABRT), and a finished run exits -6. So: collect the
    wrappers the caller let go of (DDP's hooks make cycles), then destroy the group, which frees
    it while every thread can still take the GIL (torch releases the GIL to destruct it). Not
    after a failure: freeing the backend joins its threads, and one may wait in a collective
    for a rank that will never join it.
    """
    gc.collect()
    dist.destroy_process_group()


def group_options(config: Any) -> dict[str, Any]:
    """:func:`process_group`'s options from a run's config (``dist`` and ``parallel`` sections).

    ``parallel.mode=zero1`` preloads ``torch.distributed.optim``: like ``torch.distributed.nn``
    below, it captures ``group.WORLD`` in a default argument when first imported, and importing
    it for every run would cost ddp runs about 0.35 s.
    """
    d = config.dist
    preload = ("torch.distributed.optim",) if config.parallel.mode == "zero1" else ()
    return dict(backend=d.backend, device=d.device, timeout=d.timeout, debug=d.debug, preload=preload)


def _prepare_process(device: torch.device, *, debug: bool, trace_dir: str | os.PathLike | None, preload: tuple[str, ...] = ()) -> None:
    """What must be set before the group is created: the CUDA device, debug mode, NCCL's flight recorder.

    Also imports ``torch.distributed.nn`` while no group exists: its functions take
    ``group=group.WORLD`` as a default argument, evaluated on first import, and DDP imports the
    module later, once our group exists; ten default arguments would then keep the group alive
    past ``destroy_process_group``, into interpreter shutdown (see :func:`_destroy`).
    """
    import torch.distributed.nn  # noqa: F401  (its defaults then hold None, not our group)

    for module in preload:
        importlib.import_module(module)

    if device.type == "cuda":
        torch.cuda.set_device(device)
    if debug:
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    if trace_dir is not None and device.type == "cuda":
        os.makedirs(trace_dir, exist_ok=True)  # the dump goes there on a timeout
        for name, value in flight_recorder_env(device, trace_dir).items():
            os.environ.setdefault(name, value)  # read when the NCCL group is created; the user's values win


def _existing_group_store(env: DistEnv) -> Any:
    """The store of a group the caller created, after checking it is the group ``env`` describes."""
    if dist.get_world_size() != env.world_size or dist.get_rank() != env.rank:
        raise LaunchError(
            f"an existing process group has rank {dist.get_rank()} of {dist.get_world_size()}, "
            f"but the environment says RANK={env.rank} of WORLD_SIZE={env.world_size}"
        )
    return _default_store()


def flight_recorder_env(device: torch.device, trace_dir: str | os.PathLike) -> dict[str, str]:
    """The variables that turn on NCCL's flight recorder for a group on ``device`` (none off CUDA).

    The recorder keeps the last collectives of every NCCL group in a ring buffer; when a
    collective times out, each rank dumps it to ``<trace_dir>/nccl_trace_rank_<rank>`` (read it
    with ``python -m torch.distributed.flight_recorder.fr_trace <trace_dir>``). Names as in torch
    2.14 (``TORCH_NCCL_TRACE_BUFFER_SIZE`` and ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` are the older
    spellings of the first and last); a variable the user set either way is left alone.
    """
    if device.type != "cuda":
        return {}
    wanted = {
        ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"): "2000",  # collectives kept per group
        ("TORCH_NCCL_DUMP_ON_TIMEOUT",): "1",
        ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"): os.path.join(os.fspath(trace_dir), "nccl_trace_rank_"),
    }
    return {names[0]: value for names, value in wanted.items() if not any(name in os.environ for name in names)}


def _init(env: DistEnv, backend: str, timeout: float) -> Any:
    """Create the default group; return the store it was built on."""
    kwargs: dict[str, Any] = dict(backend=backend, timeout=datetime.timedelta(seconds=timeout))
    try:
        if env.launcher == "none":
            # No launcher, no rendezvous: a private in-memory store makes a group of one.
            kwargs.update(store=dist.HashStore(), rank=0, world_size=1)
        elif env.launcher == "torchrun":
            kwargs.update(_torchrun_store(env, timeout))
        else:  # SLURM: a TCPStore on the first node, as init_method="tcp://..." would make
            url = f"tcp://{_host(env.master_addr)}:{env.master_port}?rank={env.rank}&world_size={env.world_size}"
            store, _, _ = next(dist.rendezvous(url, timeout=datetime.timedelta(seconds=timeout)))
            kwargs.update(store=store, rank=env.rank, world_size=env.world_size)
        dist.init_process_group(**kwargs)
    except (RuntimeError, ValueError, OSError) as exc:  # DistNetworkError and DistStoreError are RuntimeErrors
        raise _launch_error(env, exc) from None
    return kwargs["store"]


def _default_store() -> Any:
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
    if env.rank == 0 and not agent_store and is_loopback(env.master_addr):  # ``ddpkit run`` on one node
        return {"store": loopback_store(env.master_port, world_size=env.world_size, timeout=timeout), "rank": 0, "world_size": env.world_size}
    store, rank, world_size = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=timeout)))
    if agent_store:
        store = dist.PrefixStore(f"ddpkit/attempt_{env.restart_count}", store)
    return {"store": store, "rank": rank, "world_size": world_size}


def is_loopback(addr: str) -> bool:
    """Whether ``addr`` (a MASTER_ADDR) names this machine's loopback interface (127.0.0.0/8, ::1, localhost)."""
    with suppress(ValueError):
        return ipaddress.ip_address(addr.strip("[]")).is_loopback
    return addr == "localhost"


def loopback_store(port: int, *, world_size: int | None = None, timeout: float = 300.0, addr: str = "127.0.0.1") -> dist.TCPStore:
    """A TCPStore server listening on ``addr`` (loopback) only, on ``port`` (0: a free one): for jobs on one machine.

    torch's TCPStore server listens on every interface, whatever host name it is given; handed a
    socket bound to loopback (``master_listen_fd``) it listens there. Both stores of a one-node
    ``ddpkit run`` come from here: the launcher's rendezvous store (:mod:`ddpkit.launch.torchrun_adapter`)
    and rank 0's (:func:`_torchrun_store`). ``world_size``: wait for that many clients, as torch does.
    """
    with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own server does: TIME_WAIT leftovers of a restart
        sock.bind((addr.strip("[]"), port))
        sock.listen(socket.SOMAXCONN)
        bound = sock.getsockname()[1]
        fd = sock.detach()  # the store owns the socket from here
    return dist.TCPStore(
        addr, bound, world_size, True, datetime.timedelta(seconds=timeout),
        wait_for_workers=world_size is not None, master_listen_fd=fd,
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


# --- collectives that are safe at any world size ------------------------------------------


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def barrier(*, debug: bool = False, timeout: float | None = None) -> None:
    """Wait for every rank. With ``debug`` on Gloo, a stuck rank is named in the error."""
    if not _active():
        return
    if debug and dist.get_backend() == "gloo":
        kwargs = {"timeout": datetime.timedelta(seconds=timeout)} if timeout else {}
        dist.monitored_barrier(wait_all_ranks=True, **kwargs)
    else:
        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over ranks in place and return it."""
    if _active():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (``[obj]`` without a group)."""
    if not _active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """``obj`` from rank ``src`` on every rank."""
    if not _active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
