"""The ``parallel.mode`` wrappers: DDP, DDP + ZeRO-1, or FSDP2, all torch's own engines.

    model = shard_model(model, runtime, cfg.parallel, precision=cfg.train.precision)  # fsdp2: fully_shard, in place
    optimizer = shard_optimizer(build_optimizer(model.parameters(), cfg.optim), cfg.parallel, model=model)  # zero1
    wrapped = wrap_for_mode(model, runtime, cfg.ddp, cfg.parallel)    # ddp / zero1: DDP; fsdp2: the sharded model
    with sync_gradients(wrapped, sync=is_boundary):                   # no_sync(), or set_requires_gradient_sync
        loss.backward()
    with full_parameters(model):                                      # validation: no collective per forward
        metrics = evaluate(model, ...)

Order matters: FSDP2 replaces each parameter by a sharded ``DTensor``, so ``shard_model`` runs
before the optimizer is built (it must see the DTensors); ZeRO-1 needs the finished optimizer's
class and hyperparameters, so ``shard_optimizer`` runs after. The device mesh is built explicitly
(``init_device_mesh`` on the runtime's device type: a CPU mesh on Gloo, CUDA on NCCL).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ddpkit.config.schema import DDPConfig, ParallelConfig
from ddpkit.distributed import ddp
from ddpkit.distributed.memory import log_rank_bytes
from ddpkit.distributed.process_group import Runtime
from ddpkit.errors import ConfigError

__all__ = [
    "shard_model",
    "shard_optimizer",
    "wrap_for_mode",
    "sync_gradients",
    "full_parameters",
    "fsdp_blocks",
    "is_sharded",
    "gradient_norm",
]

log = logging.getLogger(__name__)

_PRECISION = {"bf16": torch.bfloat16, "fp32": None}


def shard_model(
    model: nn.Module, runtime: Runtime, parallel: ParallelConfig, *, precision: str = "fp32", mesh: Any = None
) -> nn.Module:
    """``fully_shard`` each block, then the root, over ``mesh`` (``fsdp2``); else ``model``.

    ``mesh``: the layout's 1-D data-parallel mesh (a slice of its (pp, dp, tp) mesh, so FSDP2 composes with a
    tensor plan's DTensors on the ``tp`` slice); None: a mesh over every rank, built here.
    """
    if parallel.mode != "fsdp2":
        return model
    if len(ddp.devices_of(model)) > 1:
        raise ConfigError(
            "parallel.mode: fsdp2 shards a model over one device a rank, and this model's parameters are on several "
            "(placed by hand); build it on one device, or use parallel.mode=ddp"
        )
    # Imported here: FSDP2 pulls in DTensor and sympy (about a second) that ddp and zero1 never use.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = model.to(runtime.device)
    if mesh is None:
        mesh = init_device_mesh(runtime.device.type, (runtime.env.world_size,), mesh_dim_names=("dp",))
    # Gradients are reduced in fp32 whatever the compute precision: bf16 sums drift from DDP's.
    mp_policy = MixedPrecisionPolicy(param_dtype=_PRECISION[precision], reduce_dtype=torch.float32)
    blocks = fsdp_blocks(model, parallel.fsdp.blocks)
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=parallel.fsdp.reshard_after_forward, mp_policy=mp_policy)
    # The root keeps its parameters for the backward (FSDP2's rule).
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    # Restored after validation.
    model._ddpkit_reshard_after_forward = parallel.fsdp.reshard_after_forward
    log.info(
        "fsdp2: %d block(s) sharded over %d rank(s) (%s), then the root",
        len(blocks),
        mesh.size(),
        ", ".join(sorted({type(b).__name__ for b in blocks})) or "none",
    )
    return model


def fsdp_blocks(model: nn.Module, names: list[str] | None) -> list[nn.Module]:
    """The submodules sharded as one unit each: by class name, or the default rule (docs/modes.md).

    Default: every child that has parameters, of the outermost ``nn.ModuleList`` / ``nn.Sequential``
    containers (a transformer's layer list, an MLP's layers); the root keeps whatever is left.
    """
    if names is not None:
        found = [m for m in model.modules() if type(m).__name__ in names and m is not model]
        missing = sorted(set(names) - {type(m).__name__ for m in found})
        if missing:
            known = sorted({type(m).__name__ for m in model.modules()})
            raise ConfigError(
                f"parallel.fsdp.blocks: no submodule of class {', '.join(missing)} "
                f"in the model; its classes are {', '.join(known)}"
            )
        return _outermost(found)
    return list(_container_children(model))


def _container_children(module: nn.Module) -> Iterator[nn.Module]:
    for child in module.children():
        if isinstance(child, (nn.ModuleList, nn.Sequential)):
            yield from (c for c in child.children() if any(True for _ in c.parameters()))
        else:
            yield from _container_children(child)


def _outermost(modules: list[nn.Module]) -> list[nn.Module]:
    """Drop modules nested inside another listed one: FSDP2 units must not overlap in this use."""
    inner = {id(sub) for m in modules for sub in m.modules() if sub is not m}
    return [m for m in modules if id(m) not in inner]


def shard_optimizer(
    optimizer: torch.optim.Optimizer, parallel: ParallelConfig, *, model: nn.Module | None = None, group: Any = None
) -> torch.optim.Optimizer:
    """``zero1``: the same optimizer class and groups inside ``ZeroRedundancyOptimizer``; else ``optimizer``.

    ``group``: the data-parallel replicas' process group (a pipeline's); None: every rank.
    With ``model``, every rank's parameter, gradient and optimizer-state bytes are then logged
    (:func:`ddpkit.distributed.memory.log_rank_bytes`, a collective): the layout is final here.
    """
    if parallel.mode == "zero1" and type(optimizer).__name__ != "ZeroRedundancyOptimizer":
        # Imported here: ddp runs never load it.
        from torch.distributed.optim import ZeroRedundancyOptimizer

        groups = [dict(group) for group in optimizer.param_groups]
        zero = ZeroRedundancyOptimizer(
            groups[0].pop("params"),
            optimizer_class=type(optimizer),
            process_group=group,
            **_hyper(optimizer, groups[0]),
        )
        for group in groups[1:]:
            zero.add_param_group(group)
        optimizer = zero
    if model is not None:
        layout = parallel.mode if parallel.tensor == 1 else f"{parallel.mode}, parallel.tensor={parallel.tensor}"
        log_rank_bytes(model, optimizer, mode=layout)
    return optimizer


def _hyper(optimizer: torch.optim.Optimizer, group: dict) -> dict:
    """The constructor's keyword arguments out of a param group (AdamW's group also holds ones it sets itself)."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return {k: v for k, v in {**optimizer.defaults, **group}.items() if k in accepted and k != "params"}


def wrap_for_mode(model: nn.Module, runtime: Runtime, options: DDPConfig, parallel: ParallelConfig) -> nn.Module:
    """What training calls: the FSDP2 model as it is, or DDP around ``model`` (``ddp``, ``zero1``).

    A tensor-parallel model under ``ddp`` is its one replica (the layout refuses more): as it is too.
    """
    if is_sharded(model) or parallel.tensor > 1:
        return model
    if parallel.mode == "fsdp2":
        raise RuntimeError(
            "parallel.mode=fsdp2 but the model was not sharded: call shard_model before building the optimizer"
        )
    return ddp.wrap_model(model, runtime, options)


def gradient_norm(
    parameters: list[torch.Tensor], max_norm: float | None = None, *, stages: Any = None, counted: Any = None
) -> torch.Tensor:
    """The global L2 norm of the gradients (clipped to ``max_norm`` when given), the same in every mode.

    FSDP2's gradients are DTensor shards whose norm is a partial value per rank; it is made whole
    (one all-reduce) before clipping, as torchtitan does, or each rank would clip by its own shard.
    ``stages``: a pipeline's process group, whose ranks each hold some of the parameters: the squares of the
    ``counted`` parameters (a tied matrix once) are summed over it, and every stage clips by that one norm.
    """
    if stages is not None:
        return _pipeline_norm(parameters, counted, max_norm, stages)
    grads = [p.grad for p in parameters if p.grad is not None]
    if max_norm is None and (buckets := _bucket_buffers(grads)) is not None:
        # The same values read as DDP's flat buckets (``ddp.gradient_as_bucket_view``): one dot product
        # per bucket, on memory the all-reduce just wrote (52 -> 18 us in the MLP's loop). Not for
        # clipping, whose norm must have torch's own bits: another summation order differs in the last
        # bits. Finite exactly when every gradient is (and, as torch's norm, inf past 1.8e19).
        if len(buckets) == 1:
            squares = torch.dot(buckets[0], buckets[0])
        else:
            squares = torch.stack([torch.dot(b, b) for b in buckets]).sum()
        return squares.sqrt()
    total = _whole_norm(grads)
    if max_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
    return total


def _whole_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of ``grads`` as a plain tensor: a DTensor's (FSDP2's or a tensor plan's) made whole."""
    if (
        grads
        and grads[0].is_cpu
        and all(type(g) is torch.Tensor and g.is_cpu and g.dtype == grads[0].dtype for g in grads)
    ):
        # On the CPU get_total_norm groups the tensors and takes one vector_norm per tensor in
        # Python (60 us a step on the test MLP); _foreach_norm runs the same kernels in one call
        # (20 us), so the same bits. Elsewhere it already uses _foreach_norm per device and dtype.
        total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    else:
        total = torch.nn.utils.get_total_norm(grads)
    if hasattr(total, "full_tensor"):
        total = total.full_tensor()
    return total


def _pipeline_norm(
    parameters: list[torch.Tensor], counted: list[torch.Tensor], max_norm: float | None, stages: Any
) -> torch.Tensor:
    grads = [p.grad for p in counted if p.grad is not None]
    if grads:
        squares = _whole_norm(grads) ** 2
    else:
        squares = torch.zeros((), device=parameters[0].device if parameters else None)
    # Each stage holds some of the parameters: the squares add up over the pipeline.
    torch.distributed.all_reduce(squares, group=stages)
    total = squares.sqrt()
    if max_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
    return total


#: The last tiling found: weak references to the gradients and to their buckets. DDP hands out the same
#: bucket views as gradients every step; weak, so a finished run's buckets are not kept alive by this.
_last_tiling: tuple[tuple[weakref.ref, ...], list[weakref.ref]] | None = None


def _bucket_buffers(grads: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """The flat buffers that ``grads`` are views of, when they tile them exactly (DDP's buckets under
    ``gradient_as_bucket_view``: each gradient a slice of one bucket, every bucket element a gradient); else None.

    Checked once for a set of gradient objects, then remembered: the step path checks that it holds
    the very same objects (0.71 us instead of 2.13 for the MLP's six gradients, `timeit`)."""
    global _last_tiling
    cached = _last_tiling is not None and len(_last_tiling[0]) == len(grads)
    if cached and all(ref() is g for ref, g in zip(_last_tiling[0], grads)):
        # Alive: the gradients are views of them.
        flat = [ref() for ref in _last_tiling[1]]
        if all(b is not None for b in flat):
            return flat
    flat = _tiled_buffers(grads)
    _last_tiling = (tuple(map(weakref.ref, grads)), [weakref.ref(b) for b in flat]) if flat is not None else None
    return flat


def _tiled_buffers(grads: list[torch.Tensor]) -> list[torch.Tensor] | None:
    buffers: dict[int, torch.Tensor] = {}
    for grad in grads:
        # Not a DTensor shard or another subclass.
        base = grad._base if type(grad) is torch.Tensor else None
        if base is None:
            return None
        buffers[id(base)] = base
    flat = list(buffers.values())
    if not flat or sum(b.numel() for b in flat) != sum(g.numel() for g in grads):
        return None
    # 1-D float32/float64 only: a sum of squares in fp16 would overflow at a norm of 256 (torch's norm does not).
    return flat if all(b.dim() == 1 and b.dtype in (torch.float32, torch.float64) for b in flat) else None


def is_sharded(model: nn.Module) -> bool:
    """True for a model that went through ``fully_shard`` (on the step path: a dict lookup, no import).

    FSDP2 is imported only when a model is sharded, so while it is not loaded no model can be one.
    """
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def sync_gradients(model: nn.Module, *, sync: bool) -> contextlib.AbstractContextManager[None]:
    """Accumulation without communication: FSDP2's ``set_requires_gradient_sync``, DDP's ``no_sync()``.

    FSDP2 decides in the backward, so the flag is set for the micro-step and set back to True on
    exit: a forgotten ``False`` would silently skip the next reduce-scatter.
    """
    if not sync and is_sharded(model):
        return _without_gradient_sync(model)
    return ddp.sync_gradients(model, sync=sync)


@contextlib.contextmanager
def _without_gradient_sync(model: Any) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


@contextlib.contextmanager
def full_parameters(model: nn.Module) -> Iterator[None]:
    """FSDP2: gather every block's parameters once, keep them through validation, free them after.

    Without this each forward all-gathers, and a rank with fewer validation batches than the
    others would wait forever in a collective. Costs the full parameters on every rank meanwhile.
    """
    if not is_sharded(model):
        yield
        return
    units = [m for m in model.modules() if is_sharded(m)]
    for unit in units:
        # The same order on every rank: each is one all-gather.
        unit.unshard()
    model.set_reshard_after_forward(False)
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
        # Back to the configured behaviour; the root never reshards after forward (FSDP2's own rule).
        after_forward = bool(getattr(model, "_ddpkit_reshard_after_forward", True))
        for unit in units:
            if unit is not model:
                unit.set_reshard_after_forward(after_forward, recurse=False)
