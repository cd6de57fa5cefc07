"""How the checkpointer saves and resumes in ``parallel.mode`` zero1 / fsdp2 and under a pipeline, and resumes
sharded checkpoints in any mode.

    run = ShardedRun.for_layout(layout, config, components, rank=rank)   # None in ddp mode (single files)
    run.save(checkpointer.capture, directory, step=..., name=..., keep_last=...)   # every rank
    state = ShardedRun.read(path)                  # the small state: what components.restore takes
    ShardedRun.restore(path, state, components)    # model + optimizer, every rank, any layout

The model and optimizer tensors go through DCP (:mod:`ddpkit.checkpoint.sharded`); every other
registered component goes, as in a single-file checkpoint, into the ``state.pt`` that rank 0 writes
inside the DCP directory, with the same metadata (RNG streams, config, versions). So the components
protocol is unchanged: ``components.restore`` receives the same dict in both formats, minus the
model and optimizer, which :meth:`ShardedRun.restore` loads itself.

A single-file checkpoint (``ddp`` mode) resumes into zero1 / fsdp2 too: its whole weights are
scattered into the shards (``set_model_state_dict(full_state_dict=True)``) and its optimizer state,
keyed by parameter position, is re-keyed by parameter name first.

``checkpoint.async: true`` uses DCP's ``async_save`` on a Gloo group of its own (collectives of
the background save must not interleave with the training loop's); the commit (rename, manifest)
happens when the next save starts or the run ends, so an unfinished one never counts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ddpkit.checkpoint import files as ckpt
from ddpkit.checkpoint import sharded
from ddpkit.checkpoint.components import Components
from ddpkit.checkpoint.metadata import manifest_fields
from ddpkit.config.schema import Config
from ddpkit.distributed.collectives import all_gather_object
from ddpkit.errors import CheckpointError
from ddpkit.reporting.log import log

__all__ = [
    "ShardedRun",
    "ShardedOptimizer",
    "TENSOR_PARTS",
    "full_capture",
    "full_model_state",
    "read_any",
    "restore_components",
]

#: The components DCP holds; everything else is small and goes into state.pt.
TENSOR_PARTS = ("model", "optimizer")


class ShardedRun:
    """The sharded save path of one run (zero1 / fsdp2)."""

    def __init__(self, components: Components, *, rank: int, async_save: bool, pipelined: bool = False):
        self.components = components
        self.rank = rank
        self.async_save = async_save
        #: Under a pipeline each rank's optimizer groups name only its stage's parameters: merged at each save.
        self.pipelined = pipelined
        # An async save not yet committed
        self._pending: tuple[Any, Path, Path, dict[str, Any]] | None = None
        self._group = None

    @classmethod
    def for_layout(cls, layout: Any, config: Config, components: Components, *, rank: int) -> ShardedRun | None:
        """The sharded save path where the layout spreads the state (zero1, fsdp2, pipelines); None otherwise."""
        if not layout.sharded_checkpoints:
            return None
        return cls(components, rank=rank, async_save=config.checkpoint.async_save, pipelined=layout.pp > 1)

    def save(self, capture: Any, directory: str, *, step: int, name: str | None, keep_last: int) -> None:
        """Every rank: its shards into DCP; rank 0 also the rest. ``capture(exclude=...)`` is the checkpointer's
        (a collective)."""
        self.wait()
        parts = sharded.ShardedParts(*_parts(self.components))
        tensors, rest = sharded.split_tensors(parts.state_dict())
        if self.pipelined:
            rest = _every_stage_in_the_groups(rest)
        small = capture(exclude=TENSOR_PARTS)
        # The non-tensor leaves (param groups)
        small.update({part: rest.get(part, {}) for part in TENSOR_PARTS})
        small["schema"] = [*small["schema"], *TENSOR_PARTS]
        meta = manifest_fields(small, epoch=small["progress"]["epoch"])
        kwargs = dict(step=step, rank=self.rank, name=name, keep_last=keep_last, meta=meta)
        if not self.async_save:
            sharded.save_sharded(tensors, small, directory, **kwargs)
            return
        self._pending = sharded.save_sharded_async(tensors, small, directory, group=self._save_group(), **kwargs)

    def _save_group(self) -> Any:
        import torch.distributed as dist

        if self._group is None:
            # Every rank creates it at the same (first) save
            self._group = dist.new_group(backend="gloo")
        return self._group

    def wait(self) -> None:
        """Finish an async save: wait for every rank's shards, then commit it (rank 0)."""
        if self._pending is not None:
            pending = self._pending
            self._pending = None
            sharded.finish_async(pending)

    @staticmethod
    def read(path: str) -> dict[str, Any]:
        """The small state of a sharded checkpoint (state.pt), loaded safely."""
        return ckpt.load_checkpoint(Path(path) / sharded.REST_FILE)

    @staticmethod
    def restore(path: str, state: dict[str, Any], components: Components, *, order: list[str] | None = None) -> None:
        """Load the model and optimizer of ``path`` (DCP directory or single file) into this run's layout; every
        rank. ``order``: see :func:`restore_components`."""
        parts = sharded.ShardedParts(*_parts(components))
        if sharded.is_sharded_checkpoint(path):
            sharded.load_sharded(path, parts)
        else:
            parts.load_full(state["model"], state["optimizer"], order=order)
        log.info("loaded the model and optimizer of %s into this run's layout", path)


def _every_stage_in_the_groups(rest: dict[str, Any]) -> dict[str, Any]:
    """``rest`` with each optimizer group naming the parameters of every stage (a collective): rank 0 writes the
    groups, and each stage loads its own names out of them, in this layout or any other."""
    groups = rest.get("optimizer", {}).get("param_groups", [])
    every = all_gather_object(groups)
    merged = []
    for index, group in enumerate(groups):
        names: list[str] = []
        for stage_groups in every:
            names += [name for name in stage_groups[index]["params"] if name not in names]
        merged.append({**group, "params": names})
    return {**rest, "optimizer": {**rest["optimizer"], "param_groups": merged}}


class ShardedOptimizer:
    """The optimizer as a zero1 / fsdp2 run registers it: saved by every rank through DCP, never by one alone.

    A single rank holds only its part of the state (and ZeRO keeps a stale consolidated copy after a
    memory snapshot), so a one-rank capture (the crash save of a lone survivor) is refused here.
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        raise CheckpointError(
            "a zero1/fsdp2 optimizer's state is split over the ranks; it is saved by every rank (DCP), not by one"
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise CheckpointError(
            "a zero1/fsdp2 optimizer's state is loaded by every rank through ddpkit.checkpoint.sharded_run"
        )


def _parts(components: Components) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    optimizer = components["optimizer"]
    return components["model"], optimizer.optimizer if isinstance(optimizer, ShardedOptimizer) else optimizer


def read_any(path: str) -> dict[str, Any]:
    """What ``read_checkpoint`` takes: a single file's dict, or a sharded checkpoint's small state."""
    return ShardedRun.read(path) if sharded.is_sharded_checkpoint(path) else ckpt.load_checkpoint(path)


def restore_components(
    path: str,
    state: dict[str, Any],
    components: Components,
    *,
    mode: str,
    spread: bool,
    order: list[str] | None = None,
) -> None:
    """Restore every component from ``state``; model and optimizer by name and shard when either side is sharded.

    ``mode``: this run's ``parallel.mode`` (logged when the checkpoint's differs); ``spread``: this run's layout
    spreads the state; ``order``: the whole model's parameter names in its optimizer's order, where this rank
    holds only some of them (a pipeline's stages: :func:`ddpkit.training.param_groups.optimizer_order`).
    """
    saved = (state.get("config") or {}).get("parallel", {}).get("mode", "ddp")
    if saved != mode:
        log.info(
            "resuming a parallel.mode=%s checkpoint (%d rank(s)) as parallel.mode=%s", saved, state["world_size"], mode
        )
    if not spread and not sharded.is_sharded_checkpoint(path):
        # ddp from a single file: as always
        components.restore(state)
        return
    components.restore({**state, "schema": [name for name in state["schema"] if name not in TENSOR_PARTS]})
    ShardedRun.restore(path, state, components, order=order)


def full_capture(state: dict[str, Any], components: Components, *, rank: int) -> dict[str, Any]:
    """``state`` (captured without model and optimizer) completed with their whole state on rank 0, as ddp saves them.

    For a single-file copy of a sharded run (the /dev/shm memory snapshots): a collective (FSDP2
    gathers the shards, ZeRO-1 consolidates its partitions); the other ranks get ``state`` as is.
    """
    model, optimizer = _parts(components)
    weights = full_model_state(model)
    # ZeRO-1 (a ZeroRedundancyOptimizer): its state gathered on rank 0 first
    if hasattr(optimizer, "consolidate_state_dict"):
        optimizer.consolidate_state_dict(to=0)
        whole = optimizer.state_dict() if rank == 0 else {}
    else:
        api = sharded.state_dict_api()
        by_name = api.get_optimizer_state_dict(
            model, optimizer, options=api.StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        whole = sharded.by_position(by_name, model) if rank == 0 else {}
    return {**state, "model": weights, "optimizer": whole, "schema": [*state["schema"], *TENSOR_PARTS]}


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model as plain CPU tensors on rank 0 (a collective under FSDP2; empty on other ranks)."""
    if not any(hasattr(p, "full_tensor") for p in model.parameters()):
        return model.state_dict()
    api = sharded.state_dict_api()
    return api.get_model_state_dict(model, options=api.StateDictOptions(full_state_dict=True, cpu_offload=True))
