"""Sharded checkpoints (``parallel.mode`` zero1 / fsdp2): a DCP directory per step, committed by rename.

    parts = ShardedParts(model, optimizer)                   # model + optimizer in a layout-free form
    save_sharded(parts.state_dict(), rest, ckpt_dir, step=1200, rank=rank)   # every rank
    rest = load_sharded(path, parts)                         # every rank, any mode, any world size

On disk, beside the single-file checkpoints of :mod:`ddpkit.checkpoint.files`::

    step-000001200.dcp/      torch.distributed.checkpoint: .metadata + one __<rank>_0.distcp per rank,
                             and state.pt (rank 0: everything that is not a model/optimizer tensor)
    step-000001200.json      the manifest, written last: step, files and their sizes, "format": "dcp"

Every rank writes its own shard (DCP's ``save``; no gather to rank 0) into a hidden
``.step-000001200.dcp.partial`` directory. Only when DCP has finished (its ``.metadata`` is the
coordinator's last write) does rank 0 rename the directory into place and write the manifest, so a
save cut by SIGKILL at any point leaves no manifest and discovery keeps the previous checkpoint.
A save that fails (a full disk on any rank: DCP reports it on every rank) removes the ``.partial``
directory and raises the one-line error of :mod:`ddpkit.checkpoint.disk_space`.

Layout independence: :class:`ShardedParts` saves through ``torch.distributed.checkpoint.state_dict``
(``get_state_dict``/``set_state_dict``): parameters and optimizer state keyed by parameter name
(FQN), DTensor shards under FSDP2, whole tensors under DDP. ZeRO-1's optimizer is not supported
there, so its local optimizer is read the same way and each rank contributes the FQNs it owns; the
param groups come from the ZeRO wrapper, identical on every rank. DCP reshards on load, so a
checkpoint from any mode and world size loads into any other.

Safety: DCP would unpickle non-tensor values (``torch.load(weights_only=False)``), so only tensors
go into DCP; everything else (hyperparameters, counters, RNG states) goes into ``state.pt``, read
with ``weights_only=True``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddpkit.atomic import fsync_dir, write_atomically
from ddpkit.checkpoint.disk_space import room_check, state_bytes, write_failure
from ddpkit.checkpoint.files import checkpoint_path, list_checkpoints, load_checkpoint, prune, save_atomically
from ddpkit.errors import CheckpointError, first_line
from ddpkit.training.param_groups import merge_to_one_group

__all__ = [
    "ShardedParts",
    "save_sharded",
    "save_sharded_async",
    "finish_async",
    "load_sharded",
    "is_sharded_checkpoint",
    "export_model",
    "split_tensors",
    "merge",
]


def _dcp() -> Any:
    """``torch.distributed.checkpoint``, imported on first use: it pulls in DTensor and sympy
    (about a second), which a DDP run, and ``import ddpkit``, should not pay for."""
    import torch.distributed.checkpoint as dcp

    return dcp


def state_dict_api() -> Any:
    """``torch.distributed.checkpoint.state_dict`` (get/set model and optimizer state by name), on first use."""
    import torch.distributed.checkpoint.state_dict as api

    return api


log = logging.getLogger("ddpkit")

FORMAT = "dcp"
SUFFIX = ".dcp"
REST_FILE = "state.pt"


def split_tensors(tree: Any) -> tuple[Any, Any]:
    """``(tensors, rest)``: the same nesting of dicts, tensor leaves in the first, all other leaves in the second."""
    if isinstance(tree, torch.Tensor):
        return tree, None
    if not isinstance(tree, dict):
        return None, tree
    tensors = {}
    rest = {}
    for key, value in tree.items():
        t, r = split_tensors(value)
        if t is not None and not (isinstance(t, dict) and not t):
            tensors[key] = t
        if r is not None and not (isinstance(r, dict) and not r and isinstance(value, dict) and value):
            rest[key] = r
    return tensors, rest


def merge(tensors: Any, rest: Any) -> Any:
    """The inverse of :func:`split_tensors`."""
    if not isinstance(tensors, dict) or not isinstance(rest, dict):
        return tensors if tensors is not None else rest
    merged = dict(rest)
    for key, value in tensors.items():
        merged[key] = merge(value, rest.get(key))
    return merged


class ShardedParts:
    """The model and optimizer as one layout-independent state: parameter names, not positions or ranks.

    ``state_dict()`` is collective-free but must run on every rank (each holds its own shards);
    ``load_state_dict()`` accepts what any mode on any world size saved.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model = model
        self.optimizer = optimizer
        # Only a ZeroRedundancyOptimizer consolidates its state
        self._zero = hasattr(optimizer, "consolidate_state_dict")
        self._names = {p: name for name, p in model.named_parameters()}

    def state_dict(self) -> dict[str, Any]:
        api = state_dict_api()
        if not self._zero:
            return {
                "model": api.get_model_state_dict(self.model),
                "optimizer": api.get_optimizer_state_dict(self.model, self.optimizer),
            }
        # The FQNs this rank owns
        local = api.get_optimizer_state_dict(self.model, self.optimizer.optim)
        groups = [{**_hyper(g), "params": [self._names[p] for p in g["params"]]} for g in self.optimizer.param_groups]
        return {
            "model": api.get_model_state_dict(self.model),
            "optimizer": {"state": local["state"], "param_groups": groups},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        api = state_dict_api()
        api.set_model_state_dict(self.model, state["model"])
        if not self._zero:
            # An earlier release's one group: resume it as trained
            if len(state["optimizer"]["param_groups"]) == 1:
                merge_to_one_group(self.optimizer, list(self.model.parameters()))
            api.set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
            return
        saved_groups = state["optimizer"]["param_groups"]
        # ZeRO partitions by group: no regrouping
        if len(saved_groups) != len(self.optimizer.param_groups):
            raise CheckpointError(
                f"the checkpoint's optimizer has {len(saved_groups)} parameter group(s), this zero1 run's has "
                f"{len(self.optimizer.param_groups)} (optim.decay / optim.groups); resume with the grouping it was "
                "written with (optim.decay=all for a checkpoint of an earlier release), or resume under ddp or fsdp2"
            )
        for zero_group, saved in zip(self.optimizer.param_groups, saved_groups):
            # ZeRO copies these to its local optimizer at each step
            zero_group.update(_hyper(saved))
        local = api.get_optimizer_state_dict(self.model, self.optimizer.optim)
        groups = [{**_hyper(saved), "params": g["params"]} for g, saved in zip(local["param_groups"], saved_groups)]
        owned = {name for g in groups for name in g["params"]}
        states = {name: value for name, value in state["optimizer"]["state"].items() if name in owned}
        api.set_optimizer_state_dict(self.model, self.optimizer.optim, {"state": states, "param_groups": groups})

    def load_full(
        self, model_state: dict[str, Any], optimizer_state: dict[str, Any], *, order: list[str] | None = None
    ) -> None:
        """Load a single-file checkpoint's whole state (ddp mode wrote it): scattered into this layout's shards.

        ``order``: where this rank holds only some of the whole model's parameters (a pipeline's stages), the whole
        model's parameter names in the order its optimizer listed them; they take their own names out of it.
        """
        api = state_dict_api()
        whole = api.StateDictOptions(full_state_dict=True)
        if order is not None:
            own = set(self.model.state_dict())
            model_state = {name: value for name, value in model_state.items() if name in own}
        api.set_model_state_dict(self.model, model_state, options=whole)
        if self._zero:
            # ZeRO takes the position-keyed whole state and keeps its part
            self.optimizer.load_state_dict(optimizer_state)
            return
        # ids -> names as torch.optim pairs them: the saved groups' ids in order with this optimizer's parameters in
        # order (optim.decay / optim.groups: not model order); a one-group state of an earlier release: model order
        if len(optimizer_state["param_groups"]) == 1:
            merge_to_one_group(self.optimizer, list(self.model.parameters()))
        ids = [i for group in optimizer_state["param_groups"] for i in group["params"]]
        if order is None:
            order = [self._names[p] for g in self.optimizer.param_groups for p in g["params"]]
        names = dict(zip(ids, order))
        owned = set(self._names.values())
        state = {names[i]: value for i, value in optimizer_state["state"].items() if names[i] in owned}
        groups = [
            {**group, "params": [names[i] for i in group["params"] if names[i] in owned]}
            for group in optimizer_state["param_groups"]
        ]
        api.set_optimizer_state_dict(
            self.model, self.optimizer, {"state": state, "param_groups": groups}, options=whole
        )


def by_position(state: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """An optimizer state keyed by parameter name as ``torch.optim`` keys it: by position in ``model.parameters()``."""
    index = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    groups = [{**group, "params": [index[name] for name in group["params"]]} for group in state["param_groups"]]
    return {"state": {index[name]: value for name, value in state["state"].items()}, "param_groups": groups}


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def save_sharded(
    tensors: dict[str, Any],
    rest: dict[str, Any],
    directory: str | os.PathLike,
    *,
    step: int,
    rank: int,
    name: str | None = None,
    keep_last: int | None = None,
    meta: dict[str, Any] | None = None,
) -> Path:
    """Every rank writes its shard of ``tensors``; rank 0 adds ``rest``, commits by rename, writes the manifest last.

    A collective (call on every rank). Returns the final directory (complete once this returns on rank 0).
    """
    final, partial = _prepare(Path(directory), step=step, name=name, rank=rank)
    needed = _needed(tensors, rest, final)
    try:
        _dcp().save(tensors, checkpoint_id=partial)
        _finish(partial, final, rest=rest, step=step, rank=rank, keep_last=keep_last, meta=meta)
    except Exception as exc:
        # DCP's CheckpointException carries every rank's error
        raise _failed(exc, partial, final, rank=rank, needed=needed) from None
    return final


def save_sharded_async(
    tensors: dict[str, Any],
    rest: dict[str, Any],
    directory: str | os.PathLike,
    *,
    step: int,
    rank: int,
    group: Any,
    name: str | None = None,
    keep_last: int | None = None,
    meta: dict[str, Any] | None = None,
) -> tuple[Any, Path, Path, dict[str, Any]]:
    """:func:`save_sharded` with DCP's ``async_save`` on ``group``: returns once the tensors are staged to CPU.

    Pass the result to :func:`finish_async` (every rank) to wait for it and commit it.
    """
    final, partial = _prepare(Path(directory), step=step, name=name, rank=rank)
    needed = _needed(tensors, rest, final)
    future = _dcp().async_save(tensors, checkpoint_id=partial, process_group=group)
    return future, partial, final, dict(rest=rest, step=step, rank=rank, keep_last=keep_last, meta=meta, needed=needed)


def finish_async(pending: tuple[Any, Path, Path, dict[str, Any]]) -> None:
    future, partial, final, kwargs = pending
    needed = kwargs.pop("needed", 0)
    try:
        # On rank 0 this returns after every rank's shard and the metadata are written
        future.result()
        _finish(partial, final, **kwargs)
    except Exception as exc:
        raise _failed(exc, partial, final, rank=kwargs["rank"], needed=needed) from None


def _needed(tensors: dict[str, Any], rest: dict[str, Any], final: Path) -> int:
    """About what the whole save writes (this rank's shards times the ranks, plus ``state.pt``); warns when it
    will not fit."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    needed = state_bytes(tensors) * world + state_bytes(rest)
    room_check(final.parent, needed=needed, what=f"checkpoint {final.name}")
    return needed


def _failed(exc: BaseException, partial: Path, final: Path, *, rank: int, needed: int) -> CheckpointError:
    """Remove the half-written ``.partial`` directory (rank 0; the others wrote into it) and describe the failure."""
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
    newest = list_checkpoints(final.parent)
    return write_failure(
        f"checkpoint {final.name}", final.parent, exc, needed=needed, newest=newest[-1].path if newest else None
    )


def _prepare(directory: Path, *, step: int, name: str | None, rank: int) -> tuple[Path, Path]:
    final = checkpoint_path(directory, step=step, name=name, suffix=SUFFIX)
    partial = directory / f".{final.name}.partial"
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        # A save killed earlier
        for stale in directory.glob(".*.partial"):
            shutil.rmtree(stale, ignore_errors=True)
    # Nobody writes into a directory rank 0 is still clearing
    _barrier()
    return final, partial


def _finish(
    partial: Path,
    final: Path,
    *,
    rest: dict[str, Any],
    step: int,
    rank: int,
    keep_last: int | None,
    meta: dict[str, Any] | None,
) -> None:
    if rank != 0:
        return
    save_atomically(rest, partial / REST_FILE)
    commit_sharded(partial, final, step=step, meta=meta)
    if keep_last is not None:
        prune(final.parent, keep_last)


def commit_sharded(partial: Path, final: Path, *, step: int, meta: dict[str, Any] | None = None) -> None:
    """Rank 0, after DCP finished: rename the directory into place, then write the manifest (last)."""
    manifest_file = final.with_suffix(".json")
    # A checkpoint under this name stops counting before it is replaced
    manifest_file.unlink(missing_ok=True)
    if final.exists():
        shutil.rmtree(final)
    files = {f.name: f.stat().st_size for f in sorted(partial.iterdir()) if f.is_file()}
    os.replace(partial, final)
    fsync_dir(final.parent)
    manifest = {
        "format": FORMAT,
        "file": final.name,
        "files": files,
        "bytes": sum(files.values()),
        "step": step,
        "created": time.time(),
        **(meta or {}),
    }
    write_atomically(manifest_file, json.dumps(manifest, indent=1), durable=True)


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    return Path(path).suffix == SUFFIX and Path(path).is_dir()


def load_sharded(path: str | os.PathLike, parts: ShardedParts) -> dict[str, Any]:
    """Load ``path`` (any mode, any world size) into ``parts``; return the rest of the state (every rank)."""
    path = Path(path)
    rest = load_checkpoint(path / REST_FILE)
    # This layout's tensors: DCP fills them in place
    tensors, _ = split_tensors(parts.state_dict())
    try:
        _dcp().load(tensors, checkpoint_id=path)
    except Exception as exc:
        # DCP raises CheckpointException with each rank's error
        raise CheckpointError(f"cannot load the sharded checkpoint {path} into this model: {first_line(exc)}") from None
    parts.load_state_dict(
        {
            "model": merge(tensors["model"], rest.get("model", {})),
            "optimizer": merge(tensors.get("optimizer", {}), rest.get("optimizer", {})),
        }
    )
    return rest


def export_model(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The whole model of a sharded checkpoint as a plain state_dict, read in one process (``ddpkit export``).

    DCP's metadata says each parameter's full size and dtype; the shards of every rank are read
    into one tensor each. No process group needed.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(path)
    metadata = _dcp().FileSystemReader(path).read_metadata()
    model: dict[str, torch.Tensor] = {}
    for flat, item in metadata.state_dict_metadata.items():
        where = (metadata.planner_data or {}).get(flat, tuple(flat.split(".", 1)))
        if where[0] == "model" and isinstance(item, TensorStorageMetadata):
            model[".".join(map(str, where[1:]))] = torch.empty(item.size, dtype=item.properties.dtype)
    if not model:
        raise CheckpointError(f"{path} holds no model tensors; is it a ddpkit sharded checkpoint?")
    _dcp().load({"model": model}, checkpoint_id=path, no_dist=True)
    return model
