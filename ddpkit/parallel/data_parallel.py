"""The ways of holding parameters across data-parallel replicas, one class each (``parallel.mode``).

    way = data_parallel_for(cfg.parallel)           # DDP(), Zero1() or FSDP2(...): chosen once, from the config
    model = way.shard(model, mesh=layout.dp_mesh, runtime=runtime)    # fsdp2: fully_shard, in place; else as is
    optimizer = way.shard_optimizer(build_optimizer(model, cfg.optim), group=layout.dp_group)   # zero1
    wrapped = way.wrap(model, runtime, cfg.ddp, group=layout.dp_group)  # ddp / zero1: DDP; fsdp2: the model
    with way.sync_gradients(wrapped, sync=is_boundary):                 # accumulation without communication
        loss.backward()
    with way.block_by_block(model):                                     # validation: fsdp2 gathers a unit at a time
        metrics = evaluate(model, ...)

Lightning Fabric's strategies are the model: each way wraps, shards the optimizer, skips gradient sync, gathers
full parameters, says how its checkpoints are held and how many bytes a rank keeps. The layout
(:class:`ddpkit.parallel.layout.ParallelLayout`) holds one of them, so nothing after the config is read asks
which mode a run is in. This module holds the two replicated ways; FSDP2 is in :mod:`ddpkit.parallel.fsdp`.

Order matters: FSDP2 replaces each parameter by a sharded ``DTensor``, so ``shard`` runs before the optimizer is
built (it must see the DTensors); ZeRO-1 needs the finished optimizer's class and hyperparameters, so
``shard_optimizer`` runs after.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from ddpkit.config.parallel import ParallelConfig
from ddpkit.config.schema import DDPConfig
from ddpkit.distributed import ddp
from ddpkit.distributed.memory import RankBytes, replicated_bytes, zero_bytes
from ddpkit.distributed.process_group import Runtime

__all__ = ["DataParallel", "DDP", "Zero1"]


class DataParallel:
    """One way of holding parameters over the data-parallel replicas; the base is DDP's behaviour."""

    #: The ``parallel.mode`` value that selects it (logs and checkpoints name the way by it).
    name: ClassVar[str]
    #: Whether every data-parallel rank holds the same whole parameters (replica checks compare them).
    replicated: ClassVar[bool] = True
    #: Whether checkpoints are DCP directories, every rank writing its part.
    sharded_checkpoints: ClassVar[bool] = False
    #: Modules the process imports before its group exists (ddpkit.distributed.process_group says why).
    preload: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def from_config(cls, parallel: ParallelConfig, *, precision: str = "fp32") -> DataParallel:
        """The way, with its options from the ``parallel`` section (``precision``: ``train.precision``)."""
        return cls()

    def shard(self, model: nn.Module, *, mesh: Any, runtime: Runtime) -> nn.Module:
        """The model with its parameters spread over ``mesh`` (in place): replicated ways keep it as it is."""
        return model

    def wrap(self, model: nn.Module, runtime: Runtime, options: DDPConfig, *, group: Any = None) -> nn.Module:
        """What training calls: DDP around ``model`` over ``group`` (None: every rank); the model itself with one
        replica."""
        return ddp.wrap_model(model, runtime, options, group=group)

    def shard_optimizer(self, optimizer: torch.optim.Optimizer, *, group: Any = None) -> torch.optim.Optimizer:
        """The optimizer, its state spread over the replicas where the way shards it."""
        return optimizer

    def sync_gradients(self, model: nn.Module, *, sync: bool) -> contextlib.AbstractContextManager[None]:
        """A context for one micro-batch's forward and backward: with the gradients' reduction, or (``sync`` False,
        an accumulation micro-step) without it: DDP's ``no_sync()``."""
        return ddp.sync_gradients(model, sync=sync)

    def full_parameters(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """A context in which every parameter is whole on every rank (validation): nothing to do when replicated."""
        return contextlib.nullcontext()

    def gathers_in_forward(self, model: nn.Module) -> bool:
        """Whether a forward of ``model`` is a collective, gathering its parameters: fsdp2's sharded models."""
        return False

    def block_by_block(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """For validation, a context in which each forward gathers the parameters it needs one unit at a time and
        frees them after, as training does: nothing to do when the parameters are whole on every rank. Each forward
        is then a collective: every rank must run as many (ddpkit.training.evaluation pads)."""
        return contextlib.nullcontext()

    def bytes_per_rank(
        self, shapes: Sequence[tuple[int, ...]], *, world_size: int, slots: int, element_size: int = 4
    ) -> list[RankBytes]:
        """What each of ``world_size`` replicas holds of trainable parameters of ``shapes``, with ``slots`` optimizer
        state tensors a parameter element (``ddpkit estimate``)."""
        return replicated_bytes(shapes, world_size=world_size, slots=slots, element_size=element_size)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class DDP(DataParallel):
    """DistributedDataParallel: every replica holds everything; one all-reduce of the gradients a step."""

    name = "ddp"


class Zero1(DataParallel):
    """DDP with the optimizer's state spread over the replicas (torch's ``ZeroRedundancyOptimizer``): after each
    step every replica broadcasts the parameters it updated."""

    name = "zero1"
    sharded_checkpoints = True
    # torch.distributed.optim captures group.WORLD when first imported: before the group exists.
    preload = ("torch.distributed.optim",)

    def shard_optimizer(self, optimizer: torch.optim.Optimizer, *, group: Any = None) -> torch.optim.Optimizer:
        """The same optimizer class and groups inside ``ZeroRedundancyOptimizer`` over ``group`` (None: every
        rank)."""
        if type(optimizer).__name__ == "ZeroRedundancyOptimizer":
            return optimizer
        # Imported here: ddp runs never load it.
        from torch.distributed.optim import ZeroRedundancyOptimizer

        groups = [dict(group) for group in optimizer.param_groups]
        zero = ZeroRedundancyOptimizer(
            groups[0].pop("params"),
            optimizer_class=type(optimizer),
            process_group=group,
            **_hyper(optimizer, groups[0]),
        )
        for extra in groups[1:]:
            zero.add_param_group(extra)
        return zero

    def bytes_per_rank(
        self, shapes: Sequence[tuple[int, ...]], *, world_size: int, slots: int, element_size: int = 4
    ) -> list[RankBytes]:
        return zero_bytes(shapes, world_size=world_size, slots=slots, element_size=element_size)


def _hyper(optimizer: torch.optim.Optimizer, group: dict) -> dict:
    """The constructor's keyword arguments out of a param group (AdamW's group also holds ones it sets itself)."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return {k: v for k, v in {**optimizer.defaults, **group}.items() if k in accepted and k != "params"}
