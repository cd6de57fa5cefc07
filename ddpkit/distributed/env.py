"""Read the launcher's environment variables once into an immutable :class:`DistEnv`.

The ways a process can be started, checked in this order:

* ``torchrun`` (or ``ddpkit run``, which uses torch's launcher) sets ``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``. They must all be
  present or all absent: a half-set environment is a launch mistake and gets a clear error, as
  does a ``WORLD_SIZE`` other than nodes (``GROUP_WORLD_SIZE``) x ``LOCAL_WORLD_SIZE``.
  One exception: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` with neither local
  variable (``launcher="env"``) is one process per host, or per set of visible GPUs: what a
  PyTorchJob pod running plain ``python`` and dask-pytorch-ddp set (local rank 0 of 1).
* ``mpirun`` (Open MPI, MVAPICH, MPICH, Intel MPI) and LSF's ``jsrun``: their own variables
  (``OMPI_COMM_WORLD_*``, ``PMI_RANK`` ..., ``JSM_NAMESPACE_*``), read by
  :mod:`ddpkit.distributed.launcher_env`, with 127.0.0.1 and an agreed port on one node.
* ``srun`` (SLURM, one task per GPU) sets ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``;
  the master address is the first host of ``SLURM_STEP_NODELIST`` unless ``MASTER_ADDR`` is set.
* Kubeflow's ``PET_*`` variables (a TrainJob's pod) without torchrun's are refused with the fix:
  each pod would otherwise train alone.
* Nothing set, but this process already has a default process group (the user called
  ``torch.distributed.init_process_group`` with an explicit rank and world size before building the
  Trainer): that group's rank and world size (``launcher="existing"``). The group is adopted as it is
  and never destroyed by ddpkit (:func:`ddpkit.distributed.process_group.process_group`).
* Nothing set and no group: a world of one (``python train.py``), which runs the very same code path.

Ray Train's ``TorchTrainer`` sets torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) and creates the group before the training
function runs, so a Trainer there reads as ``launcher="torchrun"`` and adopts Ray's group (docs/ray.md);
so does Spark's ``TorchDistributor``, which starts torchrun in every barrier task (docs/engines.md).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from ddpkit.distributed.launcher_env import check_kubeflow_env, read_mpi_env
from ddpkit.distributed.launcher_env import env_int as _int
from ddpkit.errors import LaunchError

__all__ = ["DistEnv", "read_dist_env", "TORCHRUN_VARS"]

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# torch's env:// rendezvous needs these four; without the local two, one process per host (launcher="env").
GLOBAL_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job. Field names follow torch's launcher variables."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    #: ``"torchrun"`` (also Ray Train, Spark's TorchDistributor), ``"env"`` (torchrun's global variables
    #: only), ``"mpi"``, ``"lsf"`` (jsrun), ``"slurm"``, ``"existing"`` (a group the user created, no launcher
    #: variables) or ``"none"`` (a single process started by hand).
    launcher: str = "none"
    #: How many times torchrun has restarted the worker group (``TORCHELASTIC_RESTART_COUNT``).
    restart_count: int = 0

    @property
    def is_main(self) -> bool:
        """True on global rank 0, the rank that writes files."""
        return self.rank == 0


def read_dist_env(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Build a :class:`DistEnv` from ``environ`` (default ``os.environ``).

    Args:
        environ: the variables to read: torchrun's (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ...) or,
            without them, an MPI launcher's or jsrun's (:mod:`ddpkit.distributed.launcher_env`), or
            inside ``srun`` SLURM's (``SLURM_PROCID``, ``SLURM_NTASKS``, ...).
            By default ``os.environ``, and then a process group that already exists counts too.

    Returns:
        The immutable reading; with no launcher variable set, the existing default group's place
        (only when ``environ`` is not given), else a world of one (rank 0 of 1).

    Raises:
        LaunchError: some but not all of a launcher's variables are set, a value is not a valid number,
            a Kubeflow pod runs without torchrun, or an MPI job across nodes has no ``MASTER_ADDR``.
    """
    environ = os.environ if environ is None else environ
    ranked = any(name in environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if not ranked:
        # Under mpirun, jsrun or srun, MASTER_ADDR / MASTER_PORT alone (exported by many job scripts)
        # only choose the rendezvous address; they are not half of a torchrun environment.
        mpi = read_mpi_env(environ)
        if mpi is not None:
            return DistEnv(**mpi)
        if _inside_srun(environ):
            return _from_slurm(environ)
    if "LOCAL_RANK" not in environ:
        check_kubeflow_env(environ)
    present = [name for name in TORCHRUN_VARS if name in environ]
    if all(name in environ for name in GLOBAL_VARS) and not {"LOCAL_RANK", "LOCAL_WORLD_SIZE"} & set(environ):
        return _from_torchrun({**environ, "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}, launcher="env")
    # LOCAL_WORLD_SIZE is optional: older launchers and torch.multiprocessing users omit it.
    required = [name for name in TORCHRUN_VARS if name != "LOCAL_WORLD_SIZE"]
    if present and any(name not in environ for name in required):
        missing = [name for name in required if name not in environ]
        raise LaunchError(
            f"partial torchrun environment: {', '.join(present)} set but {', '.join(missing)} missing. "
            "Launch with `torchrun --nproc-per-node=N script.py` or `ddpkit run CONFIG`, "
            "or unset these variables to run a single process."
        )
    if present:
        return _from_torchrun(environ)
    if environ is os.environ:
        return _from_existing_group() or DistEnv()
    return DistEnv()


def _from_existing_group() -> DistEnv | None:
    """This process's place in a default group the user created without launcher variables, if any."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    # Without LOCAL_RANK, the GPU the user chose for this process (torch.cuda.set_device) is its local rank.
    local_rank = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else 0
    return DistEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=max(local_rank + 1, 1),
        launcher="existing",
    )


def _from_torchrun(environ: Mapping[str, str], *, launcher: str = "torchrun") -> DistEnv:
    world_size = _int(environ, "WORLD_SIZE", minimum=1)
    rank = _int(environ, "RANK", minimum=0)
    local_rank = _int(environ, "LOCAL_RANK", minimum=0)
    local_world_size = _int(environ, "LOCAL_WORLD_SIZE", minimum=1) if "LOCAL_WORLD_SIZE" in environ else world_size
    if rank >= world_size:
        raise LaunchError(
            f"RANK={rank} is not below WORLD_SIZE={world_size}; check the launcher's --nnodes and --nproc-per-node"
        )
    if local_rank >= local_world_size:
        raise LaunchError(
            f"LOCAL_RANK={local_rank} is not below LOCAL_WORLD_SIZE={local_world_size}; "
            "check the launcher's --nproc-per-node"
        )
    if world_size % local_world_size:
        raise LaunchError(
            f"WORLD_SIZE={world_size} is not a multiple of LOCAL_WORLD_SIZE={local_world_size}: every node "
            "must run the same --nproc-per-node, and WORLD_SIZE must equal --nnodes x --nproc-per-node"
        )
    # torchrun sets GROUP_WORLD_SIZE to the number of agents (nodes) in the rendezvous.
    nodes = _int(environ, "GROUP_WORLD_SIZE", minimum=1) if "GROUP_WORLD_SIZE" in environ else None
    if nodes is not None and nodes * local_world_size != world_size:
        raise LaunchError(
            f"WORLD_SIZE={world_size} does not match {nodes} node(s) (GROUP_WORLD_SIZE) x "
            f"{local_world_size} process(es) per node (LOCAL_WORLD_SIZE) = {nodes * local_world_size}: "
            "start every node with the same --nnodes and --nproc-per-node, and set WORLD_SIZE "
            "(if you set it by hand) to --nnodes x --nproc-per-node"
        )
    return DistEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        master_addr=environ["MASTER_ADDR"],
        master_port=_int(environ, "MASTER_PORT", minimum=0),
        launcher=launcher,
        restart_count=(
            _int(environ, "TORCHELASTIC_RESTART_COUNT", minimum=0) if "TORCHELASTIC_RESTART_COUNT" in environ else 0
        ),
    )


def _inside_srun(environ: Mapping[str, str]) -> bool:
    """True inside an ``srun`` step with several tasks (not a bare ``salloc`` shell)."""
    in_step = all(k in environ for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_ID"))
    return in_step and environ["SLURM_NTASKS"] != "1"


def _from_slurm(environ: Mapping[str, str]) -> DistEnv:
    world_size = _int(environ, "SLURM_NTASKS", minimum=1)
    # SLURM_STEP_TASKS_PER_NODE looks like "4(x2)": 4 tasks on each of 2 nodes.
    tasks_per_node = re.match(r"\d+", environ.get("SLURM_STEP_TASKS_PER_NODE", ""))
    local_world_size = int(tasks_per_node.group()) if tasks_per_node else world_size
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST", "127.0.0.1")
    job_id = environ.get("SLURM_JOB_ID", "0")
    # A port derived from the job id: every task computes the same one without talking.
    default_port = 15000 + int(job_id) % 20000 if job_id.isdigit() else 29500
    return DistEnv(
        rank=_int(environ, "SLURM_PROCID", minimum=0),
        local_rank=_int(environ, "SLURM_LOCALID", minimum=0) if "SLURM_LOCALID" in environ else 0,
        world_size=world_size,
        local_world_size=local_world_size,
        master_addr=environ.get("MASTER_ADDR") or first_slurm_host(nodelist),
        master_port=_int(environ, "MASTER_PORT", minimum=0) if "MASTER_PORT" in environ else default_port,
        launcher="slurm",
        restart_count=_int(environ, "SLURM_RESTART_COUNT", minimum=0) if "SLURM_RESTART_COUNT" in environ else 0,
    )


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``"gpu[07-09,12],cpu1"`` -> ``"gpu07"``."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        return nodelist
    prefix, ranges = match.groups()
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]
