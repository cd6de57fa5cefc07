"""A host copy of a state tree, for a checkpoint written in the background while training goes on.

    staging = HostStaging()
    host = staging.copy(state)     # on the training thread: queues the copies, returns at once on a GPU
    staging.synchronize()          # on the writer thread: wait until every copy has landed
    torch.save(host, f)            # the state as it was at the copy, whatever training did since

Three pieces make the training thread's part of an asynchronous save nearly free on a GPU:

- Pinned (page-locked) host memory: a GPU-to-host copy into it is a DMA the GPU runs on its own,
  so ``copy_(..., non_blocking=True)`` only queues it. Into ordinary pageable memory the same copy
  goes through a driver bounce buffer and the calling thread waits for every byte.
- Reuse: pinning is slow (every page is locked and mapped) and the state is the same size at
  every save, so the buffers are allocated by the first copy and reused by every later one; a
  buffer whose tensor changed shape or dtype is reallocated, alone. The host memory of one copy of
  the state stays held for the life of the staging.
- An event: a CUDA event recorded after the copies, on the stream they were queued on. The
  writer thread waits on it (:meth:`HostStaging.synchronize`) before reading, so it never
  serialises half-copied bytes.

The copies are queued on the current stream, so the next step's kernels, the optimizer's in-place
update included, run after them: the host copy is the state at the moment of the save. (A side
stream would overlap the copies with the next forward and backward, but the update would then have
to wait on it; not worth the risk.) The GPU still spends the DMA's time before the next step's
kernels; the training thread does not wait for it.

The caller must not :meth:`~HostStaging.copy` again while the previous copy is still being read:
:class:`ddpkit.checkpoint.files.AsyncCheckpointWriter` waits for the previous save first.

Tensors on the CPU (RNG states, a CPU model) are copied into reused ordinary buffers, at once;
only a tensor on CUDA gets a pinned one (pinning needs a driver). Anything that cannot be staged
exactly (a tensor subclass such as a DTensor, a non-contiguous or sparse tensor, another device)
gets a fresh copy from :func:`to_cpu`, synchronously, as every save did before. Other values are
kept as they are; dicts, lists and tuples are rebuilt.
"""

from __future__ import annotations

from typing import Any

import torch

from ddpkit.checkpoint.components import StateTree

__all__ = ["HostStaging", "to_cpu"]


def to_cpu(state: StateTree) -> StateTree:
    """A deep copy of ``state`` with every tensor cloned to CPU memory (fresh memory at each call)."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: to_cpu(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(to_cpu(v) for v in state)
    return state


def _stageable(tensor: torch.Tensor) -> bool:
    """Whether a copy into a plain dense buffer holds exactly what ``to_cpu`` would."""
    return (
        type(tensor) is torch.Tensor
        and tensor.layout == torch.strided
        and not tensor.is_quantized
        and tensor.device.type in ("cpu", "cuda")
        and tensor.is_contiguous()
    )


class HostStaging:
    """Reusable host buffers that a state tree is copied into (see the module docstring)."""

    def __init__(self) -> None:
        # In the order copy() meets the tensors
        self._buffers: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event] = []
        self._used = 0

    def copy(self, state: StateTree) -> StateTree:
        """``state`` with every tensor copied into a host buffer; copies from CUDA are queued, not waited for."""
        self._used = 0
        devices = set()
        host = self._walk(state, devices)
        # The tree shrank: give the rest back
        del self._buffers[self._used :]
        self._events = [_record_event(device) for device in devices]
        return host

    def synchronize(self) -> None:
        """Block until every copy queued by the last :meth:`copy` has landed in host memory."""
        for event in self._events:
            event.synchronize()

    def _walk(self, value: Any, devices: set[torch.device]) -> Any:
        if isinstance(value, torch.Tensor):
            if not _stageable(value):
                return to_cpu(value)
            if value.is_cuda:
                devices.add(value.device)
            return self._buffer(value).copy_(value.detach(), non_blocking=value.is_cuda)
        if isinstance(value, dict):
            return {k: self._walk(v, devices) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._walk(v, devices) for v in value)
        return value

    def _buffer(self, source: torch.Tensor) -> torch.Tensor:
        """The next buffer, reused when it fits ``source`` (a CUDA source needs a pinned one), else a new one."""
        index = self._used
        self._used = self._used + 1
        pin = source.is_cuda
        if index < len(self._buffers):
            old = self._buffers[index]
            if old.shape == source.shape and old.dtype == source.dtype and (not pin or old.is_pinned()):
                return old
        new = torch.empty(source.shape, dtype=source.dtype, pin_memory=pin)
        self._buffers[index : index + 1] = [new]
        return new


def _record_event(device: torch.device) -> torch.cuda.Event:
    """An event after everything queued so far on ``device``'s current stream (where ``copy_`` put the copies)."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event
