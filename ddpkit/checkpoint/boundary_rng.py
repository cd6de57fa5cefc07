"""Each rank's torch RNG state at its last step boundaries, in a small shared-memory file another process can read.

    slots = BoundarySlots.create(path, torch.get_rng_state().numel())   # once per attempt, on every rank
    slots.write(step, torch.get_rng_state(), final=False)               # as step ``step``'s update ends: provisional
    slots.write(step, torch.get_rng_state())                            # at the step boundary (next batch): final
    found = read_boundary(path, step)                                   # the crash saver, for a dead rank:
                                                                        # (tensor, final) or None

The crash save (:mod:`ddpkit.checkpoint.crash_save`) runs on a surviving rank, but exact resume needs every
rank's own torch stream (per-rank dropout masks). So every rank publishes its boundary state here:
one file per rank (``/dev/shm/ddpkit-pids-<run>/<session>-<attempt>-rank<r>.rng``), sized and mapped
once, with two slots written alternately by step parity. A dead rank's last boundary ``k`` and the one
before stay readable even if it died while writing ``k + 1``. A rank killed after step ``k``'s update
but before its next batch (in logging, validation, a hook) never reached boundary ``k``, so the
state as the update ends is written too, marked provisional; the saver decides whether it may use it.
Each slot is ``[step: int64, length: int64, final: int64, payload bytes, marker: int64]``; the writer first
sets the marker to -1, then writes step, length and payload, and the marker (= step) last, so a slot whose
writer was killed half-way has marker -1 (or a marker that differs from its step) and is refused. The step
path pays two ctypes stores, one ``memmove`` of 5 KB and one store: no pickling, no system call.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
from pathlib import Path

import torch

__all__ = ["BoundarySlots", "read_boundary", "slot_offset", "HEADER", "TRAILER"]

#: Step, length, final (1: the boundary's state; 0: as the update ended)
HEADER = struct.Struct("<qqq")
#: Marker: the step, written last; -1 while the slot is being written
TRAILER = struct.Struct("<q")


def slot_offset(slot: int, capacity: int) -> int:
    """Where slot 0 or 1 starts in a file whose payloads hold ``capacity`` bytes."""
    return slot * (HEADER.size + capacity + TRAILER.size)


class BoundarySlots:
    """The writer side: one rank's file, mapped once; ``write`` is the only per-step call."""

    def __init__(self, path: Path, capacity: int):
        self.path = path
        self.capacity = capacity
        size = slot_offset(2, capacity)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        # Per slot: the addresses of the header words, the payload and the marker, computed once.
        self._slots = [self._addresses(base + slot_offset(s, capacity)) for s in (0, 1)]
        for slot in self._slots:
            # The file starts as zeros, which would read as a valid step 0
            slot[-1].value = -1

    def _addresses(self, start: int) -> tuple[ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, int, ctypes.c_int64]:
        step, length, final = (ctypes.c_int64.from_address(start + 8 * i) for i in range(3))
        marker = ctypes.c_int64.from_address(start + HEADER.size + self.capacity)
        return step, length, final, start + HEADER.size, marker

    @classmethod
    def create(cls, path: Path, capacity: int) -> BoundarySlots | None:
        """The file at ``path``, or None (logged by the caller) when it cannot be made."""
        try:
            return cls(path, capacity)
        except (OSError, ValueError):
            return None

    def write(self, step: int, state: torch.Tensor, *, final: bool = True) -> None:
        """Publish ``state`` (a contiguous uint8 CPU tensor, as torch.get_rng_state() returns) as step ``step``'s."""
        n = state.numel()
        step_at, length_at, final_at, payload_at, marker_at = self._slots[step & 1]
        # First: from here on a reader refuses this slot until the marker is back
        marker_at.value = -1
        if n > self.capacity:
            return
        step_at.value = step
        length_at.value = n
        final_at.value = final
        ctypes.memmove(payload_at, state.data_ptr(), n)
        # The marker last: a reader takes the slot only once the state is whole
        marker_at.value = step

    def close(self) -> None:
        """Drop the mapping (the file stays until unlinked)."""
        self._slots = []
        try:
            self._map.close()
        except BufferError:
            # A ctypes view still alive somewhere: the mapping goes with the process
            pass


def read_boundary(path: Path, step: int) -> tuple[torch.Tensor, bool] | None:
    """The torch RNG state a rank published for ``step`` and whether it is final; None: no file, no such slot,
    or a torn one."""
    try:
        # One read: a copy the writer can no longer change
        data = path.read_bytes()
    except OSError:
        return None
    capacity = len(data) // 2 - HEADER.size - TRAILER.size
    if capacity <= 0 or len(data) != slot_offset(2, capacity):
        return None
    start = slot_offset(step & 1, capacity)
    got, length, final = HEADER.unpack_from(data, start)
    (marker,) = TRAILER.unpack_from(data, start + HEADER.size + capacity)
    if got != step or marker != step or not 0 < length <= capacity:
        return None
    return (
        torch.frombuffer(bytearray(data[start + HEADER.size : start + HEADER.size + length]), dtype=torch.uint8),
        bool(final),
    )
