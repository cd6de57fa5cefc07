"""Distributed setup: the launcher's environment, the process group, model wrapping, agreement.

    from ddpkit.distributed import read_dist_env, Runtime
    env = read_dist_env()                 # torchrun's / SLURM's variables, read once
    runtime = Runtime.setup(env, cfg.dist)

- ``env``: :class:`DistEnv`, the immutable reading of the environment.
- ``process_group``: backend and device choice, init and teardown, small collective helpers.
- ``ddp``: DistributedDataParallel with the config's options, and unwrapping for saving.
- ``sharding``: ``parallel.mode``: DDP, DDP + ZeroRedundancyOptimizer, or FSDP2's ``fully_shard``.
- ``memory``: the bytes each rank holds (parameters, gradients, optimizer state), measured or predicted.
- ``agreement``: every rank agrees at startup (config, model, data, versions), and a checkpoint
  agrees with the run that resumes it.
"""

from ddpkit.distributed.env import DistEnv, read_dist_env
from ddpkit.distributed.process_group import Runtime

__all__ = ["DistEnv", "read_dist_env", "Runtime"]
