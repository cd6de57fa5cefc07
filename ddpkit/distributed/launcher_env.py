"""The launchers whose variables are not torchrun's: MPI (``mpirun``), LSF's ``jsrun``, and Kubernetes' ``PET_*``.

    mpirun -np 4 python train.py config.yaml                  # Open MPI, MPICH, Intel MPI: one node, nothing else
    mpirun -np 8 -H a:4,b:4 -x MASTER_ADDR=a python train.py config.yaml   # across nodes: rank 0's host
    jsrun -n 8 -a 1 -g 1 python train.py config.yaml          # LSF (export MASTER_ADDR first, as above)

:func:`ddpkit.distributed.env.read_dist_env` asks :func:`read_mpi_env` when torchrun's variables are absent.
Each launcher's variables must be all present or all absent (a half-set environment is refused):

============  ==========================  ==========================  ==================================
launcher      rank, world size            local rank, local size      ``launcher=``
============  ==========================  ==========================  ==================================
Open MPI      ``OMPI_COMM_WORLD_RANK``,   ``OMPI_COMM_WORLD_LOCAL_``  ``mpi``
              ``_SIZE``                   ``RANK``, ``_SIZE``
MVAPICH       ``MV2_COMM_WORLD_RANK``,    ``MV2_COMM_WORLD_LOCAL_``   ``mpi``
              ``_SIZE``                   ``RANK``, ``_SIZE``
MPICH, Intel  ``PMI_RANK``, ``PMI_SIZE``  ``MPI_LOCALRANKID``,        ``mpi``
MPI (Hydra)                               ``MPI_LOCALNRANKS`` (or
                                          ``PMI_LOCAL_RANK``, ``_SIZE``)
LSF jsrun     ``JSM_NAMESPACE_RANK``,     ``JSM_NAMESPACE_LOCAL_``    ``lsf``
              ``_SIZE``                   ``RANK``, ``_SIZE``
============  ==========================  ==========================  ==================================

Where the ranks meet. ``MASTER_ADDR`` and ``MASTER_PORT`` win when set. On one node (local size equal
to the world size) the address is 127.0.0.1. Across nodes no MPI variable names rank 0's host, so
``MASTER_ADDR`` is required, or, with mpi4py installed, rank 0's host name is broadcast over
``MPI.COMM_WORLD`` (once per process); else a LaunchError says how to set it. The port, when
``MASTER_PORT`` is not set, is agreed without talking: 15000 + CRC-32 of the job's id modulo 20000,
the job's id being the first of ``PMIX_NAMESPACE`` (Open MPI 4 and 5, jsrun, any PMIx launcher),
``OMPI_MCA_ess_base_jobid``, ``PMI_JOBID``, ``LSB_JOBID`` that is set: every rank of the job reads the
same one; on one node with none of them, the parent's pid (the launcher's local daemon, the
parent of every rank on the node).

Kubernetes: Kubeflow's TrainJob and PyTorchJob set ``PET_NNODES`` and ``PET_NPROC_PER_NODE`` for
torchrun to read. A pod that runs plain ``python train.py`` instead would train alone as a world of
one; :func:`check_kubeflow_env` refuses that with the fix (start the container with torchrun or
``ddpkit run``).
"""

from __future__ import annotations

import functools
import os
import zlib
from collections.abc import Mapping
from typing import Any

from ddpkit.errors import LaunchError

__all__ = ["read_mpi_env", "check_kubeflow_env", "env_int", "agreed_port", "MPI_LAUNCHERS"]

#: launcher name -> (rank, world size, [(local rank, local size), ...]) variables, checked in this order.
MPI_LAUNCHERS: dict[str, tuple[str, str, tuple[tuple[str, str], ...]]] = {
    "Open MPI": (
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        (("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),),
    ),
    "MVAPICH": (
        "MV2_COMM_WORLD_RANK",
        "MV2_COMM_WORLD_SIZE",
        (("MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),),
    ),
    "LSF jsrun": (
        "JSM_NAMESPACE_RANK",
        "JSM_NAMESPACE_SIZE",
        (("JSM_NAMESPACE_LOCAL_RANK", "JSM_NAMESPACE_LOCAL_SIZE"),),
    ),
    "MPICH / Intel MPI": (
        "PMI_RANK",
        "PMI_SIZE",
        (("MPI_LOCALRANKID", "MPI_LOCALNRANKS"), ("PMI_LOCAL_RANK", "PMI_LOCAL_SIZE")),
    ),
}
# The variables every rank of one job shares, in the order they are trusted as the job's id.
JOB_ID_VARS = ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "PMI_JOBID", "LSB_JOBID")
MASTER_ADDR_FIX = (
    "export MASTER_ADDR=<rank 0's host> and pass it to every rank (Open MPI: mpirun -x MASTER_ADDR; "
    "MPICH / Intel MPI: mpiexec -genv MASTER_ADDR <host>; jsrun passes the environment on), "
    "or pip install mpi4py to have it found"
)


def read_mpi_env(environ: Mapping[str, str]) -> dict[str, Any] | None:
    """The :class:`~ddpkit.distributed.env.DistEnv` fields an MPI or jsrun launch implies, or None outside one.

    Raises:
        LaunchError: a launcher's variables are half set, not numbers, out of range, or the job spans
            several nodes and nothing says where rank 0 is.
    """
    for name, (rank_var, size_var, local_vars) in MPI_LAUNCHERS.items():
        if rank_var in environ or size_var in environ:
            return _read(environ, name, rank_var, size_var, local_vars)
    return None


def _read(
    environ: Mapping[str, str], name: str, rank_var: str, size_var: str, local_vars: tuple[tuple[str, str], ...]
) -> dict[str, Any]:
    local = next(((r, s) for r, s in local_vars if r in environ or s in environ), local_vars[0])
    wanted = (rank_var, size_var, *local)
    missing = [var for var in wanted if var not in environ]
    if missing:
        present = [var for var in wanted if var in environ]
        raise LaunchError(
            f"partial {name} environment: {', '.join(present)} set but {', '.join(missing)} missing. "
            f"Start every rank with the MPI launcher itself (mpirun -np N python train.py ...), "
            "or use torchrun / `ddpkit run CONFIG`"
        )
    rank = env_int(environ, rank_var, minimum=0)
    world_size = env_int(environ, size_var, minimum=1)
    local_rank = env_int(environ, local[0], minimum=0)
    local_world_size = env_int(environ, local[1], minimum=1)
    if rank >= world_size or local_rank >= local_world_size or local_world_size > world_size:
        raise LaunchError(
            f"{name}: {rank_var}={rank} of {size_var}={world_size}, {local[0]}={local_rank} of "
            f"{local[1]}={local_world_size} do not fit together; check how the job was launched"
        )
    one_node = local_world_size == world_size
    addr, port = _rank0_address(environ, one_node=one_node, rank=rank)
    return dict(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        master_addr=addr,
        master_port=port,
        launcher="lsf" if rank_var.startswith("JSM_") else "mpi",
    )


def _rank0_address(environ: Mapping[str, str], *, one_node: bool, rank: int) -> tuple[str, int]:
    """(MASTER_ADDR, MASTER_PORT) for an MPI job: the variables when set, else 127.0.0.1 on one node,
    else mpi4py's broadcast; the port agreed from the job's id (:func:`agreed_port`)."""
    port = env_int(environ, "MASTER_PORT", minimum=0) if environ.get("MASTER_PORT") else None
    if environ.get("MASTER_ADDR"):
        return environ["MASTER_ADDR"], port if port is not None else _job_port(environ, one_node)
    if one_node:
        return "127.0.0.1", port if port is not None else _job_port(environ, one_node)
    found = _broadcast_rank0_host(rank)
    if found is None:
        raise LaunchError(f"this MPI job spans several nodes and MASTER_ADDR is not set: {MASTER_ADDR_FIX}")
    return found, port if port is not None else _job_port(environ, one_node)


def _job_port(environ: Mapping[str, str], one_node: bool) -> int:
    job = next((environ[var] for var in JOB_ID_VARS if environ.get(var)), None)
    if job is None and not one_node:
        raise LaunchError(
            "this MPI job spans several nodes and nothing names a port every rank agrees on "
            f"(none of {', '.join(JOB_ID_VARS)} is set): export MASTER_PORT=<a free port on rank 0's host> "
            "and pass it to every rank (mpirun -x MASTER_PORT)"
        )
    return agreed_port(job if job is not None else f"ppid-{os.getppid()}")


def agreed_port(job_id: str) -> int:
    """The port every rank of the job ``job_id`` computes alone: 15000 + CRC-32 of the id, modulo 20000."""
    return 15000 + zlib.crc32(job_id.encode()) % 20000


@functools.lru_cache(maxsize=1)
def _broadcast_rank0_host(rank: int) -> str | None:
    """Rank 0's host name, broadcast over ``MPI.COMM_WORLD`` (mpi4py); None where mpi4py is not installed.

    Cached: :func:`read_dist_env` runs more than once in a worker, and a broadcast is a collective
    that every rank must call the same number of times.
    """
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError, OSError):  # not installed, or no MPI library for it to load
        return None
    import socket

    return MPI.COMM_WORLD.bcast(socket.gethostname() if rank == 0 else None, root=0)


def check_kubeflow_env(environ: Mapping[str, str]) -> None:
    """Refuse a Kubeflow pod (``PET_*`` set) whose training processes were not started by torchrun.

    Kubeflow's TrainJob (Trainer v2) sets only ``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``,
    ``PET_MASTER_ADDR`` and ``PET_MASTER_PORT``: torchrun's options, as variables. The PyTorchJob
    (Training Operator v1) also sets ``RANK`` (the pod's index) and ``WORLD_SIZE`` (pods x processes per pod),
    right for one plain process per pod only. Called when torchrun's ``LOCAL_RANK`` is absent.
    """
    nnodes = environ.get("PET_NNODES")
    nproc = environ.get("PET_NPROC_PER_NODE")
    if nnodes is None and nproc is None:
        return
    if "RANK" in environ and nproc in (None, "1"):
        return  # a PyTorchJob of one plain process per pod: RANK and WORLD_SIZE are right
    if "RANK" not in environ and nnodes in (None, "1") and nproc in (None, "1"):
        return  # one process in one pod: a world of one
    started = "torchrun was not started" if "RANK" not in environ else f"RANK={environ['RANK']} is the pod's index"
    raise LaunchError(
        f"this is a Kubeflow job (PET_NNODES={nnodes}, PET_NPROC_PER_NODE={nproc}) but {started}: "
        "each process would train alone or wait for ranks that never come. Make the container's command "
        "torchrun, which reads the PET_* variables (command: [torchrun, train.py, CONFIG]), or "
        "`ddpkit run CONFIG --nnodes=$(PET_NNODES) --node-rank=$(PET_NODE_RANK) --master-addr=$(PET_MASTER_ADDR) "
        "--master-port=$(PET_MASTER_PORT) --nproc-per-node=$(PET_NPROC_PER_NODE)` (examples/cluster/trainjob.yaml)"
    )


def env_int(environ: Mapping[str, str], name: str, *, minimum: int) -> int:
    """``environ[name]`` as an integer of at least ``minimum``, else a LaunchError naming the variable and value."""
    text = environ[name]
    try:
        value = int(text)
    except ValueError:
        raise LaunchError(
            f"environment variable {name}={text!r} is not an integer; check how the job was launched"
        ) from None
    if value < minimum:
        raise LaunchError(f"environment variable {name}={value} must be >= {minimum}; check how the job was launched")
    return value
