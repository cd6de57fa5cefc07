"""The run's parallel layout as one value: its degrees, this rank's coordinates, and one DeviceMesh.

    layout = ParallelLayout.build(cfg.parallel, runtime, precision=cfg.train.precision)   # once, after the group
    layout.data_parallel                                     # DDP(), Zero1() or FSDP2(): how replicas hold parameters
    layout.dp, layout.dp_rank, layout.dp_group               # what samplers, token counts and replicas use
    layout.pp, layout.pp_rank, layout.pp_group               # a pipeline's stages
    layout.tp, layout.tp_rank, layout.tp_mesh                # the tensor-parallel ranks a model's plan splits over
    layout.replicated                                        # every data-parallel rank holds the same parameters
    layout.replicate, layout.dp_mesh                         # HSDP: R replicas of fsdp2's shards, a 2-D dp mesh

torchtitan's ``ParallelDims`` is the model: the degrees are checked first (``ddpkit.config.layout``,
before any group exists), then one ``DeviceMesh`` is built once and passed to everything that shards
or reduces. The mesh's dimensions are ``("pp", "dp", "tp")``, the pipeline outermost and the tensor
dimension innermost (torchtitan's order): the T ranks of one tensor-parallel group are neighbours (on a
GPU node, the fastest links carry its per-block all-reduces), the ranks of one pipeline are ``dp x tp``
apart, and rank 0 holds stage 0 of replica 0.

HSDP (``parallel.replicate`` R > 1, fsdp2) splits the data-parallel dimension in two, ``("dp_replicate",
"dp_shard")``, R x dp / R, the shard dimension inner (its ranks neighbours: one node's fast links carry the
all-gathers and reduce-scatters, and one gradient all-reduce a unit crosses the replicas). That mesh,
``("pp", "dp_replicate", "dp_shard", "tp")``, is what FSDP2 and the tensor plan use (torch's FSDP2 needs its
mesh and the tensor mesh cut from one root); the ``("pp", "dp", "tp")`` mesh is built beside it for its groups,
so a rank's data-parallel rank and group (samplers, token counts, checks) are those of plain fsdp2 over dp ranks:
the same samples.

Without a pipeline, tensor parallelism or HSDP no mesh is built: the data-parallel group is the whole world,
i.e. the default group (``dp_group`` None), exactly what every run used before layouts existed, at no
extra cost.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ddpkit.config.layout import check_layout, microbatches_of, rank_place, with_microbatches
from ddpkit.config.parallel import ParallelConfig
from ddpkit.config.schema import Config
from ddpkit.distributed.env import DistEnv
from ddpkit.distributed.process_group import Runtime
from ddpkit.parallel.data_parallel import DDP, DataParallel, Zero1
from ddpkit.parallel.fsdp import FSDP2

__all__ = ["ParallelLayout", "DATA_PARALLEL", "data_parallel_for"]


#: Each ``parallel.mode`` value's class: the only place the mode is read.
DATA_PARALLEL: dict[str, type[DataParallel]] = {way.name: way for way in (DDP, Zero1, FSDP2)}


def data_parallel_for(parallel: ParallelConfig, *, precision: str = "fp32") -> DataParallel:
    """The way ``parallel.mode`` names, built once from the config (``precision``: ``train.precision``)."""
    return DATA_PARALLEL[parallel.mode].from_config(parallel, precision=precision)


@dataclass(frozen=True)
class ParallelLayout:
    """The degrees (dp, pp, tp), this rank's coordinates and groups, and how parameters are held."""

    #: How the data-parallel replicas hold parameters: DDP(), Zero1() or FSDP2() (ddpkit.parallel.data_parallel).
    data_parallel: DataParallel
    dp: int
    pp: int
    dp_rank: int
    pp_rank: int
    tp: int = 1
    tp_rank: int = 0
    #: The ``("pp", "dp", "tp")`` DeviceMesh; None with neither a pipeline, tensor parallelism nor HSDP (then the
    #: default group is the dp group).
    mesh: Any = None
    #: HSDP's replicas R (``parallel.replicate``): each holds the model sharded over dp / R ranks.
    replicate: int = 1
    #: HSDP's ``("pp", "dp_replicate", "dp_shard", "tp")`` DeviceMesh; None when ``replicate`` is 1.
    hsdp_mesh: Any = None

    @classmethod
    def build(cls, parallel: ParallelConfig, runtime: Runtime, *, precision: str = "fp32") -> ParallelLayout:
        """Check the degrees against the world size, then build the mesh (a collective) for a pipeline or tensor
        parallelism. ``precision``: ``train.precision``, which FSDP2 computes in."""
        env = runtime.env
        way = data_parallel_for(parallel, precision=precision)
        check_layout(parallel, world_size=env.world_size)
        stages = parallel.pipeline
        tensor = parallel.tensor
        replicas = env.world_size // (stages * tensor)
        replicate = parallel.replicate
        if stages == 1 and tensor == 1 and replicate == 1:
            return cls.without_mesh(way, env)
        # Imported here: DeviceMesh pulls in DTensor, which plain data-parallel runs never need.
        from torch.distributed.device_mesh import init_device_mesh

        shape = (stages, replicas, tensor)
        mesh = init_device_mesh(runtime.device.type, shape, mesh_dim_names=("pp", "dp", "tp"))
        hsdp_mesh = None
        if replicate > 1:
            hsdp_mesh = init_device_mesh(
                runtime.device.type,
                (stages, replicate, replicas // replicate, tensor),
                mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"),
            )
        return cls(
            data_parallel=way,
            dp=replicas,
            pp=stages,
            dp_rank=mesh.get_local_rank("dp"),
            pp_rank=mesh.get_local_rank("pp"),
            tp=tensor,
            tp_rank=mesh.get_local_rank("tp"),
            mesh=mesh,
            replicate=replicate,
            hsdp_mesh=hsdp_mesh,
        )

    @classmethod
    def without_mesh(cls, way: DataParallel, env: Any) -> ParallelLayout:
        """The layout of a run without a pipeline or tensor parallelism: every rank a data-parallel replica (no
        collective)."""
        return cls(data_parallel=way, dp=env.world_size, pp=1, dp_rank=env.rank, pp_rank=0)

    @property
    def dp_group(self) -> Any:
        """The process group of this rank's data-parallel replicas (None: the default group, every rank)."""
        return None if self.mesh is None else self.mesh.get_group("dp")

    @property
    def pp_group(self) -> Any:
        """The process group of this rank's pipeline (its stages); None without a pipeline."""
        return None if self.pp == 1 else self.mesh.get_group("pp")

    @property
    def dp_mesh(self) -> Any:
        """What FSDP2 shards over: the 1-D mesh of this rank's data-parallel replicas, or under HSDP the 2-D
        ``("dp_replicate", "dp_shard")`` mesh (replicated over the first, sharded over the second); None without a
        mesh."""
        if self.hsdp_mesh is not None:
            return self.hsdp_mesh["dp_replicate", "dp_shard"]
        return None if self.mesh is None else self.mesh["dp"]

    @property
    def tp_mesh(self) -> Any:
        """The 1-D mesh of this rank's tensor-parallel group (what a tensor plan splits over); None when T is 1."""
        if self.tp == 1:
            return None
        # Under HSDP from FSDP2's own root mesh: torch refuses a tensor mesh and a data mesh of different roots.
        return (self.mesh if self.hsdp_mesh is None else self.hsdp_mesh)["tp"]

    @property
    def replicated(self) -> bool:
        """Whether every data-parallel rank holds the same whole parameters (ddp, zero1), not shards (fsdp2)."""
        return self.data_parallel.replicated

    @property
    def splits_model(self) -> bool:
        """Whether a rank holds only part of the model: a pipeline, a tensor plan, or fsdp2's shards (ddp and zero1
        hold it whole on every rank)."""
        return self.pp > 1 or self.tp > 1 or not self.data_parallel.replicated

    @property
    def sharded_checkpoints(self) -> bool:
        """Whether checkpoints are DCP directories, every rank writing its part: sharded modes, pipelines, tensor
        parallelism."""
        return self.data_parallel.sharded_checkpoints or self.pp > 1 or self.tp > 1

    @property
    def whole_model_on_each_rank(self) -> bool:
        """Whether one rank alone can save the whole training state (the crash save, memory snapshots)."""
        return not self.sharded_checkpoints

    def data_env(self, env: DistEnv) -> DistEnv:
        """The environment the samplers shard by: the data-parallel coordinate (the stages of one pipeline, and the
        ranks of one tensor-parallel group, read the same batches); ``env`` itself when every rank is a replica."""
        if self.dp == env.world_size:
            return env
        return dataclasses.replace(env, rank=self.dp_rank, world_size=self.dp)

    def data_config(self, config: Config) -> Config:
        """The config the data sees: under a pipeline, its M microbatches are the accumulation."""
        if self.pp == 1:
            return config
        return with_microbatches(config, microbatches_of(config.parallel))

    def describe(self) -> str:
        """One line for the log: the degrees and this rank's coordinates."""
        if self.mesh is None:
            return f"data-parallel {self.dp} ({self.data_parallel.name})"
        way = self.data_parallel.name
        if self.replicate > 1:
            way += f": {self.replicate} replicas x {self.dp // self.replicate} shards"
        degrees = [f"data-parallel {self.dp} ({way})"]
        if self.pp > 1:
            degrees.insert(0, f"pipeline {self.pp}")
        if self.tp > 1:
            degrees.append(f"tensor {self.tp}")
        # The watchdog's reports name a rank the same way (ddpkit.watchdog.report).
        where = rank_place(
            pp_rank=self.pp_rank, dp_rank=self.dp_rank, tp_rank=self.tp_rank, pipeline=self.pp, tensor=self.tp
        )
        if self.replicate > 1:
            shards = self.dp // self.replicate
            where += f" (HSDP: shard {self.dp_rank % shards} of replica {self.dp_rank // shards})"
        return f"{' x '.join(degrees)}: this rank is {where}"
