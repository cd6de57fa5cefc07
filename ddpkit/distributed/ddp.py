"""Wrap a model in DistributedDataParallel with the config's options; unwrap it for saving.

    model = wrap_model(model, runtime, cfg.ddp)     # DDP when world_size > 1, else the bare model
    with sync_gradients(model, sync=is_boundary):   # no_sync() for accumulation micro-steps
        loss.backward()
    torch.save(unwrap_model(model).state_dict(), path)

Options keep torch's names (``bucket_cap_mb``, ``find_unused_parameters``, ``static_graph``,
``gradient_as_bucket_view``, ``broadcast_buffers``); ``comm_hook`` registers one of torch's DDP
communication hooks (fp16 / bf16 compression, PowerSGD).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit.config.schema import DDPConfig
from ddpkit.distributed.bucket_layout import pin_bucket_layout
from ddpkit.distributed.process_group import Runtime

# torch 2.14 renamed DDP's `broadcast_buffers` to `forward_sync_buffers` (same meaning for
# forward-time syncing) and warns on the old name; use whichever this torch has.
_BUFFER_SYNC_ARG = (
    "forward_sync_buffers"
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
    else "broadcast_buffers"
)

__all__ = ["wrap_model", "devices_of", "unwrap_model", "strip_wrapper_prefixes", "sync_gradients", "parameter_shapes"]


def wrap_model(
    model: nn.Module, runtime: Runtime, options: DDPConfig, *, group: Any = None, pinned: bool = True
) -> nn.Module:
    """Move ``model`` to the runtime's device and wrap it in DDP when there is more than one replica.

    ``group``: the data-parallel replicas' process group (a pipeline stage's); None: every rank. ``pinned``: the
    bucket layout pinned for bitwise resume (``ddpkit.distributed.bucket_layout``); False leaves the model free
    for a communication hook of the caller's own (``ddp.comm_hook`` is then not registered either).
    With one replica the bare model is returned: DDP would only add overhead. ``device_ids`` is
    passed only on CUDA (DDP rejects it for CPU modules).
    """
    replicas = runtime.env.world_size if group is None else dist.get_world_size(group)
    if options.sync_batchnorm and replicas > 1:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group=group)
    # A model the user placed across several devices (its halves on cuda:0 and cuda:1) stays where it is, and DDP
    # takes it with device_ids=None, as torch documents for multi-device modules.
    spans_devices = len(devices_of(model)) > 1
    # A model already on the device is left as it is: DTensor's .to() makes a new tensor even then, and
    # Module._apply swaps it into the parameter, dropping the gradient hooks a tensor plan gave it.
    tensors = itertools.chain(model.parameters(), model.buffers())
    if not spans_devices and any(t.device != runtime.device for t in tensors):
        model = model.to(runtime.device)
    if replicas == 1:
        return model
    single = runtime.device.type == "cuda" and not spans_devices
    device_ids = [runtime.device.index] if single else None
    ddp = DDP(
        model,
        device_ids=device_ids,
        process_group=group,
        bucket_cap_mb=options.bucket_cap_mb,
        find_unused_parameters=options.find_unused_parameters,
        static_graph=options.static_graph,
        gradient_as_bucket_view=options.gradient_as_bucket_view,
        **{_BUFFER_SYNC_ARG: options.broadcast_buffers},
    )
    # One bucket layout from the first step on, so a resume beyond 2 ranks adds in the same order
    # (ddpkit.distributed.bucket_layout); PowerSGD and find_unused_parameters go through torch as they are.
    if not pinned:
        return ddp
    if pin_bucket_layout(ddp, options) is None:
        _register_comm_hook(ddp, options)
    return ddp


def devices_of(model: nn.Module) -> set[torch.device]:
    """The devices ``model``'s parameters are on: more than one for a model placed by hand across devices."""
    return {p.device for p in model.parameters()}


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module inside DDP and ``torch.compile``, in any nesting: its state_dict has no ``module.``
    and no ``_orig_mod.`` prefix, so it loads into the bare network whether or not it was compiled."""
    while True:
        if isinstance(model, DDP):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            # torch.compile's OptimizedModule
            model = model._orig_mod
        else:
            return model


def sync_gradients(model: nn.Module, *, sync: bool) -> contextlib.AbstractContextManager[None]:
    """A context for forward + backward: with gradient allreduce (``sync=True``) or under DDP's ``no_sync()``.

    Gradient accumulation uses ``sync=False`` for the first k-1 micro-steps: gradients pile up
    locally and only the k-th backward communicates, so accumulation costs one allreduce per
    optimizer step instead of k. (DDP decides at forward time, so the forward must be inside.)
    """
    if sync:
        # One shared object: nothing allocated per step.
        return _NO_CONTEXT
    # torch.compile(DDP(model)): DDP is one level in.
    while not isinstance(model, DDP):
        model = getattr(model, "_orig_mod", None)
        if model is None:
            return _NO_CONTEXT
    return model.no_sync()


_NO_CONTEXT = contextlib.nullcontext()


def _register_comm_hook(ddp: DDP, options: DDPConfig) -> None:
    if options.comm_hook == "none":
        return
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if options.comm_hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif options.comm_hook == "bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif options.comm_hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=options.powersgd_rank,
            start_powerSGD_iter=options.powersgd_start_iter,
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    else:  # pragma: no cover - the config schema only allows the values above
        raise AssertionError(options.comm_hook)


def parameter_shapes(model: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of every parameter, in order: what ranks compare at startup."""
    return [(name, tuple(p.shape)) for name, p in unwrap_model(model).named_parameters()]


def strip_wrapper_prefixes(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` without the ``module.`` (DDP) and ``_orig_mod.`` (torch.compile) prefixes a
    wrapped model's own ``state_dict()`` carries, in any nesting: keys the bare network accepts.

    ddpkit always saves the unwrapped model; this is for files written elsewhere (a hand-written
    loop that saved ``compiled.state_dict()``), on export and resume.
    """
    cleaned = dict(state_dict)
    changed = True
    while changed and cleaned:
        changed = False
        for prefix in ("_orig_mod.", "module."):
            if all(key.startswith(prefix) for key in cleaned):
                cleaned = {key[len(prefix) :]: value for key, value in cleaned.items()}
                changed = True
    return cleaned
