"""Keep freed host memory in the process, so a training step reuses pages instead of faulting in new ones; or give
it back, so a rank's resident memory follows what it holds.

    keep_freed_host_memory()     # once per process, before the loop (the Trainer's build step does it)
    give_back_host_memory()      # or this, where memory matters more than page faults (a split model's layouts)
    keeps_host_memory(cfg.train.keep_host_memory, splits_model=layout.splits_model)   # which of the two

PyTorch's CPU tensors come from glibc ``malloc``. With glibc's defaults, a large block (an
activation or its gradient: a 64 x 10 x 24 x 24 float32 conv output is 1.5 MB) is either
``mmap``-ed and unmapped again on free, or carved from the top of the heap and given back to the
kernel when the top grows past the trim threshold. Either way the next step's allocation of the
same size faults in fresh zero-filled pages: measured here, 200 to 1,900 minor page faults per
MNIST-CNN step (batch 64), 0.7 to 5 ms of kernel time on a 15-25 ms step, and *how many* depends
on where long-lived small allocations happen to sit in the heap. That is why two identical
loops in one process could measure 1.16x apart in one run and 0.98x in the next.

Setting ``M_TRIM_THRESHOLD`` high and ``M_MMAP_THRESHOLD`` to glibc's own dynamic maximum (32 MiB)
makes freed blocks stay in the heap for reuse: about one fault per step (under 40 when a loop
keeps a small block every step), whatever the layout. The
cost is that memory freed during training is not returned to the kernel while the process lives
(GPU caching allocators behave the same way). Blocks over 32 MiB are still mapped and unmapped.
Only glibc has ``mallopt``; elsewhere this does nothing.

Giving memory back is the other side. glibc's defaults do not: after the first large block is freed its dynamic
threshold rises to that block's size (up to 32 MiB), and freed blocks below it stay in the heap, scattered. A rank
that holds a part of a large model (fsdp2, a pipeline, a tensor plan) then carries hundreds of MiB it does not use:
measured on a 946 MiB Llama under fsdp2 on 2 ranks, a steady training peak of 2,987 MiB above the baseline with
the defaults, 2,931 kept, 2,494 given back (``benchmarks/memory.py``). :func:`give_back_host_memory` fixes the
thresholds low (blocks of 128 KiB and more mapped and unmapped, glibc's own static default; the heap's top trimmed
past 16 MiB), at the cost of page faults on each step's blocks. 128 KiB and not 1 MiB: a language model's activations
are a few hundred KiB each (64 tokens x 1,024 features in fp32 is 256 KiB), and below the threshold they were carved
from the heap, where a freed one between two live ones cannot be given back. Measured on that Llama (3 steps): tp2's
peak 2,302 -> 2,173 MiB, pp2's 2,324 -> 2,171, pp2 x tp2's 1,306 -> 1,199; the cost, measured on a 4-block tp2 run
(farm-bench, 5 pairs): 1.04x the wall time, about 5% fewer tokens a second.

``train.keep_host_memory``: ``true`` keeps, ``false`` gives back, null (the default) keeps where every rank holds
the whole model (a world of one, ddp, zero1) and gives back where the layout splits it, which it does for memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

__all__ = ["keep_freed_host_memory", "give_back_host_memory", "keeps_host_memory", "apply_host_memory"]

#: glibc's <malloc.h> parameter numbers.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit.
_MMAP_THRESHOLD = 32 * 1024 * 1024
_TRIM_THRESHOLD = 1024 * 1024 * 1024
#: Giving back: blocks from 128 KiB mapped and unmapped, the heap's top trimmed past 16 MiB.
_GIVE_BACK_MMAP_THRESHOLD = 128 * 1024
_GIVE_BACK_TRIM_THRESHOLD = 16 * 1024 * 1024

#: Which setting this process applied: "keep", "give back", or None (none yet).
_applied: str | None = None


def keeps_host_memory(setting: bool | None, *, splits_model: bool) -> bool:
    """``train.keep_host_memory`` resolved: as set, or (null) keep unless the layout splits the model."""
    return (not splits_model) if setting is None else setting


def apply_host_memory(setting: bool | None, *, splits_model: bool) -> bool:
    """Keep or give back host memory as ``train.keep_host_memory`` resolves (:func:`keeps_host_memory`); whether it
    applied (glibc only)."""
    if keeps_host_memory(setting, splits_model=splits_model):
        return keep_freed_host_memory()
    return give_back_host_memory()


def keep_freed_host_memory() -> bool:
    """Tell glibc malloc to keep freed blocks up to 32 MiB for reuse; return whether it applied.

    Idempotent and process-wide. Returns False (and changes nothing) on a C library without
    ``mallopt``, e.g. macOS or musl.
    """
    return _set_thresholds("keep", mmap=_MMAP_THRESHOLD, trim=_TRIM_THRESHOLD)


def give_back_host_memory() -> bool:
    """Tell glibc malloc to map blocks from 128 KiB and give them back when freed, and to trim the heap's top past
    16 MiB; return whether it applied. Process-wide; a no-op (False) without glibc."""
    return _set_thresholds("give back", mmap=_GIVE_BACK_MMAP_THRESHOLD, trim=_GIVE_BACK_TRIM_THRESHOLD)


def _set_thresholds(name: str, *, mmap: int, trim: int) -> bool:
    """``mallopt`` both thresholds once per process (the first setting asked for wins); whether ``name`` applies."""
    global _applied
    if _applied is not None:
        return _applied == name
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        # Both must be set: setting either turns off glibc's dynamic threshold, and the mmap
        # threshold decides which blocks can be kept at all.
        if libc.mallopt(_M_MMAP_THRESHOLD, mmap) and libc.mallopt(_M_TRIM_THRESHOLD, trim):
            _applied = name
    except (OSError, AttributeError):
        return False
    return _applied == name
