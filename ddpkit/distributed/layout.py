"""The run's parallel layout as one value: its degrees, this rank's coordinates, and one DeviceMesh.

    layout = ParallelLayout.build(cfg.parallel, runtime)     # once, after the process group exists
    layout.dp, layout.dp_rank, layout.dp_group               # what samplers, token counts and replicas use
    layout.pp, layout.pp_rank, layout.pp_group               # a pipeline's stages
    layout.replicated                                        # every data-parallel rank holds the same parameters

torchtitan's ``ParallelDims`` is the model: the degrees are checked first (``ddpkit.config.layout``,
before any group exists), then one ``DeviceMesh`` is built once and passed to everything that shards
or reduces. The mesh's dimensions are ``("pp", "dp")``, the pipeline outermost, so the ranks of one
pipeline are ``dp`` apart and rank 0 holds stage 0 of replica 0; a tensor dimension joins them when
tensor parallelism lands (its degree is 1 today).

Without a pipeline no mesh is built: the data-parallel group is the whole world, i.e. the default
group (``dp_group`` None), exactly what every run used before layouts existed, at no extra cost.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ddpkit.config.layout import check_layout, microbatches_of, with_microbatches
from ddpkit.config.parallel import ParallelConfig
from ddpkit.config.schema import Config
from ddpkit.distributed.env import DistEnv
from ddpkit.distributed.process_group import Runtime

__all__ = ["ParallelLayout"]


@dataclass(frozen=True)
class ParallelLayout:
    """The degrees (dp, pp, tp), this rank's coordinates and groups, and how parameters are held."""

    mode: str
    dp: int
    pp: int
    dp_rank: int
    pp_rank: int
    tp: int = 1
    #: The ``("pp", "dp")`` DeviceMesh; None without a pipeline (then the default group is the dp group).
    mesh: Any = None

    @classmethod
    def build(cls, parallel: ParallelConfig, runtime: Runtime) -> ParallelLayout:
        """Check the degrees against the world size, then build the mesh (a collective) when there is a pipeline."""
        env = runtime.env
        check_layout(parallel, world_size=env.world_size)
        stages = parallel.pipeline
        replicas = env.world_size // stages
        if stages == 1:
            return cls.data_parallel(parallel.mode, env)
        # Imported here: DeviceMesh pulls in DTensor, which runs without a pipeline never need.
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(runtime.device.type, (stages, replicas), mesh_dim_names=("pp", "dp"))
        return cls(
            mode=parallel.mode,
            dp=replicas,
            pp=stages,
            dp_rank=mesh.get_local_rank("dp"),
            pp_rank=mesh.get_local_rank("pp"),
            mesh=mesh,
        )

    @classmethod
    def data_parallel(cls, mode: str, env: Any) -> ParallelLayout:
        """The layout of a run without a pipeline: every rank a data-parallel replica (no collective)."""
        return cls(mode=mode, dp=env.world_size, pp=1, dp_rank=env.rank, pp_rank=0)

    @property
    def dp_group(self) -> Any:
        """The process group of this rank's data-parallel replicas (None: the default group, every rank)."""
        return None if self.mesh is None else self.mesh.get_group("dp")

    @property
    def pp_group(self) -> Any:
        """The process group of this rank's pipeline (its stages); None without a pipeline."""
        return None if self.mesh is None else self.mesh.get_group("pp")

    @property
    def replicated(self) -> bool:
        """Whether every data-parallel rank holds the same whole parameters (ddp, zero1), not shards (fsdp2)."""
        return self.mode != "fsdp2"

    @property
    def sharded_checkpoints(self) -> bool:
        """Whether checkpoints are DCP directories, every rank writing its part: sharded modes and pipelines."""
        return self.mode in ("zero1", "fsdp2") or self.pp > 1

    @property
    def whole_model_on_each_rank(self) -> bool:
        """Whether one rank alone can save the whole training state (the crash save, memory snapshots)."""
        return self.mode == "ddp" and self.pp == 1

    def data_env(self, env: DistEnv) -> DistEnv:
        """The environment the samplers shard by: the data-parallel coordinate (the stages of one pipeline read the
        same batches); ``env`` itself without a pipeline."""
        if self.pp == 1:
            return env
        return dataclasses.replace(env, rank=self.dp_rank, world_size=self.dp)

    def data_config(self, config: Config) -> Config:
        """The config the data sees: under a pipeline, its M microbatches are the accumulation."""
        if self.pp == 1:
            return config
        return with_microbatches(config, microbatches_of(config.parallel))

    def describe(self) -> str:
        """One line for the log: the degrees and this rank's coordinates."""
        if self.pp == 1:
            return f"data-parallel {self.dp} ({self.mode})"
        return (
            f"pipeline {self.pp} x data-parallel {self.dp} ({self.mode}): this rank is stage {self.pp_rank} "
            f"of replica {self.dp_rank}"
        )
