"""Which source each window slot of a mixture reads: exact shares per global batch, computed per batch.

    schedule = BatchShares([0.5, 0.3, 0.2], global_batch_size=32, seed=0)
    schedule.counts(7)        # windows of each source in global batch 7: [16, 10, 6] or [16, 9, 7], ...
    schedule.before(7)        # windows of each source in batches 0..6, without walking them
    schedule.layout(7)        # (source, i) of every slot of batch 7, the sources interleaved

A source of weight ``w`` (out of ``W``) owns ``g = G * w / W`` of every global batch of ``G`` windows.
Each batch gives it ``floor(g)`` windows plus, in some batches, one more: so every batch holds each
source's share exactly up to one window. Which sources get the extra window in batch ``k`` is a
systematic draw: the fractional parts ``r`` of the shares are laid end to end on ``[0, R)`` (``R``,
their sum, is a whole number: the slots ``floor`` left over), and the ``R`` points ``theta_k, theta_k
+ 1, ...`` each land in one source's stretch; no stretch is longer than 1, so no source gets two.
``theta_k = frac(a * k / 2**64 + b)`` with ``a`` 2**64 over the golden ratio (a Weyl sequence, the
most even spread a rotation gives) and ``b`` from the seed, so over many batches a source's extra
windows come at rate ``r`` and its running count stays close to ``k * g``: within 4 windows over the
first 2,000 batches of the tests' mixtures, and the drift grows only as ``log k`` (under 40 windows
at batch 10**12).

Why this shape: the counts of batch ``k`` and the running totals before it are closed forms (a
lattice-point count, ``floor_sum``, in O(log k) integer steps), so a resume at step 10**9, or a
DataLoader worker asked for one window, computes its slot without replaying the schedule: the
mixture stays index-free like the token file's own order (:mod:`ddpkit.data.order`). Everything
is integer arithmetic on exact fractions of the weights: the same on every machine.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from math import floor

import numpy as np

__all__ = ["BatchShares", "floor_sum"]

# The resolution of theta: the shares' fractional parts are rounded to multiples of 2**-64.
_P = 1 << 64
# 2**64 / golden ratio, odd: the Weyl step that visits the circle most evenly.
_A = 0x9E3779B97F4A7C15


def floor_sum(n: int, m: int, a: int, b: int) -> int:
    """``sum(floor((a * i + b) / m) for i in range(n))`` in O(log) steps, for ``n, m > 0`` and ``a, b >= 0``.

    The Euclid-like reduction of the lattice-point count (as in the AtCoder Library's ``floor_sum``).
    """
    total = 0
    while True:
        if a >= m:
            total += n * (n - 1) // 2 * (a // m)
            a %= m
        if b >= m:
            total += n * (b // m)
            b %= m
        top = a * n + b
        if top < m:
            return total
        n, b, m, a = top // m, top % m, a, m


class BatchShares:
    """Per-batch window counts of each source for weights ``weights`` and global batches of ``global_batch_size``."""

    def __init__(self, weights: Sequence[float | int | Fraction], *, global_batch_size: int, seed: int):
        # 0.7 means 7/10, not its nearest double.
        exact = [Fraction(w).limit_denominator(10**9) for w in weights]
        total = sum(exact)
        shares = [global_batch_size * w / total for w in exact]
        self.base = np.array([floor(g) for g in shares], dtype=np.int64)
        running = Fraction(0)
        self._edges = [0]
        # Each source's stretch of [0, R), in units of 2**-64.
        for g in shares:
            running += g - floor(g)
            self._edges.append(round(running * _P))
        self.global_batch_size = global_batch_size
        self._offset = (seed * 0x100000001B3 + 0x2545F491) % _P

    def _extra_sum(self, k: int, edge: int) -> int:
        """``sum(floor((A*j + offset - edge) / P) for j < k)``: the shifted lattice-point count."""
        if k <= 0:
            return 0
        # Whole turns that make the constant term non-negative.
        shift = -((self._offset - edge) // _P)
        return floor_sum(k, _P, _A, self._offset - edge + shift * _P) - shift * k

    def before(self, k: int) -> np.ndarray:
        """Windows of each source in batches ``0 .. k-1``."""
        sums = [self._extra_sum(k, edge) for edge in self._edges]
        return self.base * k + np.array([sums[s] - sums[s + 1] for s in range(len(self.base))], dtype=np.int64)

    def counts(self, k: int) -> np.ndarray:
        """Windows of each source in batch ``k`` (each ``floor`` or ``ceil`` of its share; they sum to the batch)."""
        return self.before(k + 1) - self.before(k)

    def layout(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``(source, i)`` for each slot of batch ``k``: source ``s``'s ``i``-th window of the batch.

        The sources are spread through the batch (slot keys ``(i + 0.5) / count``), so every rank's
        micro-batch, a contiguous slice of the batch, holds close to each source's share as well.
        """
        counts = self.counts(k)
        sources = np.repeat(np.arange(len(counts)), counts)
        within = np.concatenate([np.arange(c) for c in counts]) if len(counts) else np.zeros(0, dtype=np.int64)
        keys = (within + 0.5) / counts[sources]
        order = np.argsort(keys, kind="stable")
        return sources[order], within[order]
