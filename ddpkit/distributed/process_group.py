"""Process-group setup and teardown, backend and device choice: the group's lifetime, in one ``with``.

    env = read_dist_env()
    with process_group(env, backend="auto", device="auto", timeout=300) as runtime:
        ...  # runtime.device, runtime.backend; collectives work, also at world size 1

A world of one (``python train.py``) still gets a real, single-member Gloo/NCCL group backed by an
in-memory store, so the training loop has exactly one code path. How the ranks meet (the store
for each launcher) is :mod:`ddpkit.distributed.rendezvous`; the collectives that are safe at any
world size are :mod:`ddpkit.distributed.collectives`.
"""

from __future__ import annotations

import gc
import importlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.config.schema import Config
from ddpkit.distributed.env import DistEnv
from ddpkit.distributed.rendezvous import default_store, init_default_group
from ddpkit.errors import ConfigError, LaunchError

__all__ = ["Runtime", "process_group", "group_options", "flight_recorder_env", "resolve_device", "resolve_backend"]


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
    store = init_default_group(env, backend, timeout) if created else _existing_group_store(env)
    try:
        yield Runtime(env=env, device=torch_device, backend=dist.get_backend(), debug=debug, store=store)
    except BaseException:
        if created and dist.is_initialized():
            # The process exits next (see ddpkit.launch.entrypoint).
            dist.destroy_process_group()
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


def group_options(config: Config, *, preload: tuple[str, ...] = ()) -> dict[str, Any]:
    """:func:`process_group`'s options from a run's config (its ``dist`` section).

    ``preload``: the modules the run's way of holding parameters imports before the group exists
    (:attr:`ddpkit.parallel.data_parallel.DataParallel.preload`): ``zero1``'s ``torch.distributed.optim``, like
    ``torch.distributed.nn`` below, captures ``group.WORLD`` in a default argument when first imported, and
    importing it for every run would cost ddp runs about 0.35 s.
    """
    d = config.dist
    return dict(backend=d.backend, device=d.device, timeout=d.timeout, debug=d.debug, preload=tuple(preload))


def _prepare_process(
    device: torch.device, *, debug: bool, trace_dir: str | os.PathLike | None, preload: tuple[str, ...] = ()
) -> None:
    """What must be set before the group is created: the CUDA device, debug mode, NCCL's flight recorder.

    Also imports ``torch.distributed.nn`` while no group exists: its functions take
    ``group=group.WORLD`` as a default argument, evaluated on first import, and DDP imports the
    module later, once our group exists; ten default arguments would then keep the group alive
    past ``destroy_process_group``, into interpreter shutdown (see :func:`_destroy`).
    """
    # Its defaults then hold None, not our group.
    import torch.distributed.nn  # noqa: F401

    for module in preload:
        importlib.import_module(module)

    if device.type == "cuda":
        torch.cuda.set_device(device)
    if debug:
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    if trace_dir is not None and device.type == "cuda":
        # The dump goes there on a timeout.
        os.makedirs(trace_dir, exist_ok=True)
        for name, value in flight_recorder_env(device, trace_dir).items():
            # Read when the NCCL group is created; the user's values win.
            os.environ.setdefault(name, value)


def _existing_group_store(env: DistEnv) -> Any:
    """The store of a group the caller created, after checking it is the group ``env`` describes."""
    if dist.get_world_size() != env.world_size or dist.get_rank() != env.rank:
        raise LaunchError(
            f"an existing process group has rank {dist.get_rank()} of {dist.get_world_size()}, "
            f"but the environment says RANK={env.rank} of WORLD_SIZE={env.world_size}"
        )
    return default_store()


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
        # Collectives kept per group.
        ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"): "2000",
        ("TORCH_NCCL_DUMP_ON_TIMEOUT",): "1",
        ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"): os.path.join(
            os.fspath(trace_dir), "nccl_trace_rank_"
        ),
    }
    return {names[0]: value for names, value in wanted.items() if not any(name in os.environ for name in names)}
