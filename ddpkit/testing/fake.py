"""Be any rank of any world size in this one process, on torch's ``fake`` backend: for tests of structure.

    from ddpkit.testing import fake_ranks

    def test_every_rank_of_a_pp2_dp2_tp2_mesh():             # one process, one rank after another
        for rank in range(8):
            with fake_ranks(8, rank=rank):
                mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
                assert tuple(mesh.get_coordinate()) == (rank // 4, rank // 2 % 2, rank % 2)

Inside the block the default process group is torch's public ``fake`` backend, so meshes and subgroups,
``DTensor`` and tensor plans, ``fully_shard`` (forward and backward), DDP's wrapper and ddpkit's layout are built
as on rank ``rank`` of ``world_size``, and torch's ``CommDebugMode`` counts the collectives they issue. But no
collective talks to anyone: an all-reduce leaves its tensor as it was, an all-gather fills every slot with this
rank's value, and a broadcast or receive gets nothing (a ``broadcast_object`` from rank 0 fails on the others).
torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``) are set as :func:`ddpkit.testing.run_on_ranks` sets them, so code that reads the environment
(``ddpkit.distributed.read_dist_env``, a Trainer, which adopts the group) sees the same place.

Use it for what the ranks' shapes decide: mesh coordinates and factorisations, tensor-plan placements, which
parameters a pipeline stage holds, layout refusals raised once the group exists, collective counts. It takes
milliseconds where starting real ranks takes seconds.

Do not use it for anything whose numbers depend on a real reduction or exchange: losses, gradients and weights
compared across ranks, DDP's reducer (its backward fails on this backend), ZeRO-1's and FSDP2's training results,
a pipeline running its schedule, the ranks' agreement checks (every rank agrees with itself), checkpoints, kills
and resumes; nor a Trainer's ``fit()`` on a rank other than 0 (rank 0 broadcasts the run lock's outcome). Those
need real Gloo ranks: :func:`ddpkit.testing.run_on_ranks`, or the ``rank_pool`` fixture.

On exit, also after an exception, the group and everything built on it (subgroups, meshes) is destroyed, the
variables are put back as they were, and ddpkit's process-wide caches are cleared (as between two calls of the
rank pool), so the next rank of a loop starts as a fresh process would.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from ddpkit.distributed.env import TORCHRUN_VARS
from ddpkit.testing.ranks import rank_environment
from ddpkit.testing.reset import _reset_ddpkit_caches

__all__ = ["fake_ranks"]


@contextmanager
def fake_ranks(world_size: int, rank: int = 0) -> Iterator[None]:
    """Be rank ``rank`` of ``world_size`` in this process: torch's ``fake`` default group and torchrun's variables.

    Args:
        world_size: how many ranks the group pretends to have (1 or more).
        rank: this process's rank in it, ``0 <= rank < world_size``.

    Raises:
        ValueError: ``world_size`` or ``rank`` is out of range.
        RuntimeError: a default process group already exists (this process is a real rank already; destroy it
            first, or use real ranks for the whole test).
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"fake_ranks: rank {rank} of world_size {world_size}; need 0 <= rank < world_size")
    if dist.is_initialized():
        raise RuntimeError(
            "fake_ranks: a default process group already exists in this process "
            f"(backend {dist.get_backend()!r}); destroy it first (torch.distributed.destroy_process_group())"
        )
    saved = {name: os.environ.get(name) for name in TORCHRUN_VARS}
    variables = rank_environment(rank, world_size)
    try:
        os.environ.update({name: variables[name] for name in TORCHRUN_VARS})
        dist.init_process_group("fake", rank=rank, world_size=world_size)
        yield
    finally:
        if dist.is_initialized():
            # The default group's destruction takes every subgroup (and so every mesh) with it.
            dist.destroy_process_group()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        _reset_ddpkit_caches()
