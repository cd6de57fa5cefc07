"""Distributed setup: the launcher's environment, the process group, model wrapping, agreement.

    from ddpkit.distributed import read_dist_env
    from ddpkit.distributed.process_group import process_group
    env = read_dist_env()                 # torchrun's / SLURM's variables, read once
    with process_group(env, backend="auto") as runtime:   # a Runtime: env, device, backend, store
        ...

- ``env``: :class:`DistEnv`, the immutable reading of the environment.
- ``launcher_env``: the launchers whose variables are not torchrun's: MPI, LSF's jsrun, Kubeflow's ``PET_*``.
- ``process_group``: backend and device choice, the group's creation and teardown (:class:`Runtime`).
- ``rendezvous``: how the ranks meet: the store for each launcher, and the one-line error when they cannot.
- ``collectives``: barrier, sum, gather and broadcast that are safe at any world size, with no group too.
- ``ddp``: DistributedDataParallel with the config's options, and unwrapping for saving.
- ``bucket_layout``: DDP's gradient buckets in one layout from the first step on, so a resume on 3+ ranks is bitwise.
- ``gradient_norm``: the gradients' global norm and clipping, the same in every layout.
- ``memory``: the bytes each rank holds (parameters, gradients, optimizer state), measured or predicted.
- ``processes``: processes on this host, from ``/proc`` (alive, parent, start time).
- ``control_auth``: the job's key (from ``ddpkit run``, or agreed over the group) and the HMAC tags on
  ddpkit's control messages in the store (stop requests, heartbeats, alarms).
- ``agreement``: every rank agrees at startup (config, model, data, versions), and a checkpoint
  agrees with the run that resumes it.
"""

# What the Trainer composes, importable from the package.
from ddpkit.distributed.agreement import check_same_run_on_every_rank
from ddpkit.distributed.env import DistEnv, read_dist_env
from ddpkit.distributed.process_group import Runtime

__all__ = ["DistEnv", "read_dist_env", "Runtime", "check_same_run_on_every_rank"]
