"""Keep freed host memory in the process, so a training step reuses pages instead of faulting in new ones.

    keep_freed_host_memory()     # once per process, before the loop (the Trainer's build step does it)

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
Only glibc has ``mallopt``; elsewhere this does nothing. ``train.keep_host_memory: false`` opts out.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

__all__ = ["keep_freed_host_memory"]

#: glibc's <malloc.h> parameter numbers.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit.
_MMAP_THRESHOLD = 32 * 1024 * 1024
_TRIM_THRESHOLD = 1024 * 1024 * 1024

_applied = False


def keep_freed_host_memory() -> bool:
    """Tell glibc malloc to keep freed blocks up to 32 MiB for reuse; return whether it applied.

    Idempotent and process-wide. Returns False (and changes nothing) on a C library without
    ``mallopt``, e.g. macOS or musl.
    """
    global _applied
    if _applied:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        # Both must be set: setting either turns off glibc's dynamic threshold, and the mmap
        # threshold decides which blocks can be kept at all.
        mmap_set = bool(libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD))
        _applied = mmap_set and bool(libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    except (OSError, AttributeError):
        return False
    return _applied
