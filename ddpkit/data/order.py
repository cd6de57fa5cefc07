"""An epoch's sample order that is never stored: position -> index, computed on demand.

    order = epoch_order(10**9, seed=0, epoch=3, kind="auto")   # no memory in N
    order.at(np.arange(0, 64))                                 # the indices at positions 0..63
    order.at(np.array([123_456_789]))                          # any position directly (resume)

``data.order`` picks the kind:

* ``index_free``: a keyed pseudo-random permutation of ``[0, N)`` computed per position (a
  Feistel network, see :class:`FeistelOrder`), O(1) memory, any position reachable directly;
* ``randperm``: ``torch.randperm(N)`` seeded with ``seed + epoch``, as ``DistributedSampler``
  does (8 bytes per sample as a tensor, about 36 as the list the samplers used to build);
* ``auto`` (the default): ``randperm`` below :data:`AUTO_THRESHOLD` samples, so existing small runs
  keep their order bit for bit, ``index_free`` from there on.

Why a Feistel network with cycle-walking (Black and Rogaway, "Ciphers with arbitrary finite
domains", 2002): it is a bijection by construction whatever its round function, so the order
is a permutation for every N without any table; it needs only the key and the position, so a
resume jumps straight to its position; each round is a few 64-bit multiply/xor/shift steps
that numpy runs on a whole chunk of positions at once. Cheaper bijections (an affine map
``a*i + b mod N``, an LCG) keep neighbouring positions in arithmetic progression, which is a
poor shuffle. With six rounds of a strong mixer (splitmix64's finaliser) the positions pass a
chi-square uniformity test (tests/test_order.py). The network runs on the next even power of
two >= N (at most 4N), and an output >= N is encrypted again until it falls inside [0, N)
(cycle-walking: still a bijection of [0, N), on average under 4 passes).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

__all__ = ["AUTO_THRESHOLD", "FeistelOrder", "RandpermOrder", "IdentityOrder", "epoch_order", "order_kind"]

#: ``data.order: auto`` keeps ``randperm`` below this many samples (its list is ~36 MB per rank at
#: 2**20); measured with python -m benchmarks.order, where the index-free order costs the same per
#: batch and saves the up-front permutation (benchmarks/RESULTS.md, "Data at scale").
AUTO_THRESHOLD = 1 << 20

_ROUNDS = 6
_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every output bit depends on every input bit (uint64 arithmetic wraps)."""
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    return x ^ (x >> np.uint64(31))


def _round_keys(seed: int, epoch: int) -> list[np.uint64]:
    """Six 64-bit round keys from (seed, epoch) alone: no global RNG, the same on every rank."""
    base = (seed * 0x100000001B3 + epoch) & _MASK64
    inputs = np.array([(base + _GOLDEN * (r + 1)) & _MASK64 for r in range(_ROUNDS)], dtype=np.uint64)
    return list(_mix(inputs))


class FeistelOrder:
    """A keyed permutation of ``[0, n)``: ``at(positions)`` gives the index at each position."""

    def __init__(self, n: int, *, seed: int, epoch: int):
        self.n = n
        # 2 * half_bits bits cover [0, n).
        half_bits = max(1, ((n - 1).bit_length() + 1) // 2)
        self._bits = np.uint64(half_bits)
        self._mask = np.uint64((1 << half_bits) - 1)
        self._keys = _round_keys(seed, epoch)

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left = x >> self._bits
        right = x & self._mask
        for key in self._keys:
            left, right = right, left ^ (_mix(right ^ key) & self._mask)
        return (left << self._bits) | right

    def at(self, positions: np.ndarray) -> np.ndarray:
        """The indices at ``positions`` (an int array, each in ``[0, n)``), as int64."""
        out = self._encrypt(np.asarray(positions, dtype=np.uint64))
        outside = out >= self.n
        # Cycle-walking: re-encrypt what fell in [n, 2**bits) until it lands inside.
        while outside.any():
            out[outside] = self._encrypt(out[outside])
            outside = out >= self.n
        return out.astype(np.int64)


class RandpermOrder:
    """``torch.randperm(n)`` seeded with ``seed + epoch``: ``DistributedSampler``'s order, held in memory."""

    def __init__(self, n: int, *, seed: int, epoch: int):
        self.n = n
        self._perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).numpy()

    def at(self, positions: np.ndarray) -> np.ndarray:
        return self._perm[positions]


class IdentityOrder:
    """No shuffle (``data.shuffle=false``): position ``i`` is index ``i``."""

    def __init__(self, n: int):
        self.n = n

    def at(self, positions: np.ndarray) -> np.ndarray:
        return np.asarray(positions, dtype=np.int64)


Order = FeistelOrder | RandpermOrder | IdentityOrder
OrderKind = Literal["auto", "index_free", "randperm"]


def order_kind(kind: str, n: int) -> str:
    """``kind`` with ``auto`` resolved for an ``n``-sample set: ``randperm`` or ``index_free``."""
    if kind == "auto":
        return "randperm" if n < AUTO_THRESHOLD else "index_free"
    return kind


def epoch_order(n: int, *, seed: int, epoch: int, kind: str = "auto", shuffle: bool = True) -> Order:
    """The order of ``epoch``: a function of ``(seed, epoch)`` only, never of the rank or world size."""
    if not shuffle:
        return IdentityOrder(n)
    if order_kind(kind, n) == "randperm":
        return RandpermOrder(n, seed=seed, epoch=epoch)
    return FeistelOrder(n, seed=seed, epoch=epoch)
