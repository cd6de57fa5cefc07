"""``ddpkit.testing.fake_ranks``: any rank of any world size in the test's own process, on torch's ``fake`` backend.

    .venv/bin/pytest -q tests/test_fake_ranks.py

No process is spawned: what is checked here is where each rank sits and what the block leaves behind.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode

from ddpkit.distributed import read_dist_env
from ddpkit.testing import fake_ranks


def test_each_of_8_ranks_sits_in_a_pp_dp_tp_mesh_as_torchrun_would_place_it():
    for rank in range(8):
        with fake_ranks(8, rank=rank):
            assert (dist.get_backend(), dist.get_rank(), dist.get_world_size()) == ("fake", rank, 8)
            env = read_dist_env()
            assert (env.rank, env.local_rank, env.world_size, env.launcher) == (rank, rank, 8, "torchrun")
            mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
            # pp outermost, tp innermost: the ranks of one tensor-parallel group are neighbours
            assert tuple(mesh.get_coordinate()) == (rank // 4, rank // 2 % 2, rank % 2), rank
            assert dist.get_process_group_ranks(mesh.get_group("tp")) == [rank - rank % 2, rank - rank % 2 + 1]


def test_collectives_are_counted_but_reduce_nothing():
    with fake_ranks(2, rank=1):
        x = torch.full((3,), 5.0)
        with CommDebugMode() as comm:
            dist.all_reduce(x)
        assert comm.get_total_counts() == 1
        # the fake backend's documented behaviour: nothing travels, so no number here means a sum
        assert x.tolist() == [5.0, 5.0, 5.0]


def _after_the_block() -> tuple[bool, str | None, str | None, str | None]:
    return dist.is_initialized(), os.environ.get("RANK"), os.environ.get("WORLD_SIZE"), os.environ.get("MASTER_PORT")


def test_the_group_goes_and_the_environment_comes_back_after_the_block_and_after_an_exception(monkeypatch):
    monkeypatch.setenv("RANK", "7")  # a value the block replaces and must give back
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # and one it sets and must remove
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with fake_ranks(4, rank=2):
        assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_PORT"]) == ("2", "4", "0")
        init_device_mesh("cpu", (2, 2))
    assert _after_the_block() == (False, "7", None, None)
    with pytest.raises(KeyError, match="raised inside"):
        with fake_ranks(4, rank=3):
            init_device_mesh("cpu", (4,))
            raise KeyError("raised inside")
    assert _after_the_block() == (False, "7", None, None)


def test_a_rank_outside_the_world_and_a_group_that_already_exists_are_refused():
    for world_size, rank in ((2, 2), (2, -1), (0, 0)):
        with pytest.raises(ValueError, match=f"rank {rank} of world_size {world_size}"):
            with fake_ranks(world_size, rank=rank):
                pass
        assert not dist.is_initialized()
    with fake_ranks(2, rank=1):
        with pytest.raises(RuntimeError, match="a default process group already exists"):
            with fake_ranks(2, rank=0):
                pass
        # the refusal touched neither the group nor the variables of the block around it
        assert (dist.is_initialized(), dist.get_rank(), os.environ["RANK"]) == (True, 1, "1")
    assert not dist.is_initialized()
