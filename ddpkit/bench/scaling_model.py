"""The cost model behind ``ddpkit bench scaling``: alpha-beta allreduce, DDP's bucket overlap, step time.

Pure arithmetic on measured inputs, no processes and no torch:

    link = Link(bandwidth=parse_bandwidth("100Gbit"), latency=parse_latency("5us"))
    ring_allreduce_s(100 << 20, 64, link)          # one 100 MiB allreduce on 64 ranks, seconds
    profile = Profile(...)                          # measured on one rank by ddpkit.bench.scaling_profile
    p = predict(profile, 64, link)                  # p.step_s, p.exposed_comm_s, p.efficiency
    cap, p = best_bucket_cap(profile, 64, link, caps_mb=[1, 5, 25, 100])

The formulas (docs/scaling.md explains them and what they ignore):

* ring allreduce of ``b`` bytes on ``n`` ranks: ``2(n-1)/n * b / B + 2(n-1) * alpha``, where ``B``
  is the bus bandwidth as ``ddpkit bench allreduce`` defines it (busbw) and ``alpha`` the latency
  of one of the ``2(n-1)`` steps;
* (double binary) tree: ``2 * ceil(log2 n) * alpha + 2 * b / B``: latency grows with log n, the
  bandwidth term is the ring's upper bound; ``best`` takes the faster of the two per bucket, as
  NCCL's tuner does;
* DDP overlap: bucket ``i``'s allreduce starts when it is launched (``ready_s``, in the order
  DDP's reducer fires the buckets) and after bucket ``i-1``'s allreduce has ended; the backward
  phase ends at ``max(backward_s, last allreduce end)``;
* step time at ``n >= 2`` ranks: ``data + forward (+ buffer broadcast) + that backward phase +
  optimizer + the wait for the slowest rank`` (:func:`straggler_s`, from the profiled spread);
  at ``n = 1`` the measured step of the bare model (the Trainer does not wrap a world of one in
  DDP); scaling efficiency = ``step_1 / step_n`` (per-rank batch fixed).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from ddpkit.bench.units import BenchUsageError

__all__ = [
    "Algorithm",
    "Bucket",
    "Link",
    "Param",
    "Prediction",
    "Profile",
    "allreduce_s",
    "assign_buckets",
    "assumed_profile",
    "best_bucket_cap",
    "broadcast_s",
    "comm_end_s",
    "fit_link",
    "parse_bandwidth",
    "parse_latency",
    "predict",
    "ring_allreduce_s",
    "straggler_s",
    "tree_allreduce_s",
]

Algorithm = Literal["ring", "tree", "best"]
MIB = 1 << 20
#: torch's first bucket when ``bucket_cap_mb`` is left at its default (``dist._DEFAULT_FIRST_BUCKET_BYTES``).
DEFAULT_FIRST_BUCKET_BYTES = 1 * MIB
DEFAULT_BUCKET_CAP_MB = 25.0


@dataclass(frozen=True)
class Link:
    """An interconnect: bus bandwidth per rank in bytes/s and per-message-step latency in seconds."""

    bandwidth: float
    latency: float
    name: str = ""

    def label(self) -> str:
        return self.name or f"{self.bandwidth * 8 / 1e9:g}Gbit/{self.latency * 1e6:g}us"


@dataclass(frozen=True)
class Bucket:
    """One gradient bucket: its size in bytes and when DDP launched it, seconds after backward began."""

    nbytes: int
    ready_s: float


@dataclass(frozen=True)
class Param:
    """One parameter's gradient: bytes, dtype name, and when it was ready, seconds after backward began."""

    nbytes: int
    ready_s: float
    dtype: str = "float32"


@dataclass(frozen=True)
class Profile:
    """What one rank measured for a config (medians over iterations), in seconds and bytes.

    Per optimizer step of one rank, ``batch_size`` samples: ``data_s`` and ``forward_s`` over all
    micro-steps, ``local_backward_s`` the backwards under ``no_sync()`` (gradient accumulation),
    ``backward_s`` the last, synchronising one, all of the DDP-wrapped model (with its bucket
    copies); ``single_step_s`` is a whole step of the bare model, which is what a world of one runs.
    ``comm_factor`` scales bucket bytes on the wire (0.5 for the fp16/bf16 comm hooks).
    ``step_samples_s``, every timed iteration's DDP-wrapped step, gives the spread from one step
    to the next that :func:`straggler_s` turns into the wait for the slowest rank.
    """

    batch_size: int
    data_s: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    local_backward_s: float
    single_step_s: float
    buckets: tuple[Bucket, ...]
    params: tuple[Param, ...] = ()
    buffer_bytes: int = 0
    comm_factor: float = 1.0
    bucket_cap_mb: float | None = None
    #: The DDP-wrapped step's time in each timed iteration, sorted.
    step_samples_s: tuple[float, ...] = ()

    @property
    def grad_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)


@dataclass(frozen=True)
class Prediction:
    """Predicted step at one world size on one link."""

    world_size: int
    step_s: float
    #: Sum of the bucket allreduces.
    comm_s: float
    #: How much of it the step waits for (not hidden behind backward).
    exposed_comm_s: float
    samples_per_s: float
    #: single_step_s / step_s.
    efficiency: float
    #: The median step's wait for the slowest of the n ranks.
    straggler_s: float = 0.0


def ring_allreduce_s(nbytes: float, n: int, link: Link) -> float:
    """Ring allreduce: reduce-scatter + all-gather, ``2(n-1)`` steps of ``b/n`` bytes each."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / link.bandwidth + 2 * (n - 1) * link.latency


def tree_allreduce_s(nbytes: float, n: int, link: Link) -> float:
    """Pipelined (double) binary tree: reduce up and broadcast down, ``2 ceil(log2 n)`` hops."""
    if n <= 1:
        return 0.0
    return 2 * math.ceil(math.log2(n)) * link.latency + 2 * nbytes / link.bandwidth


def allreduce_s(nbytes: float, n: int, link: Link, algorithm: Algorithm = "ring") -> float:
    """One allreduce with ``algorithm``; ``best`` is the faster of ring and tree for this size."""
    if algorithm == "ring":
        return ring_allreduce_s(nbytes, n, link)
    if algorithm == "tree":
        return tree_allreduce_s(nbytes, n, link)
    return min(ring_allreduce_s(nbytes, n, link), tree_allreduce_s(nbytes, n, link))


def broadcast_s(nbytes: float, n: int, link: Link) -> float:
    """Binomial-tree broadcast (DDP's buffer sync at each forward): ``ceil(log2 n)`` hops of all bytes."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return math.ceil(math.log2(n)) * (link.latency + nbytes / link.bandwidth)


def fit_link(points: Sequence[tuple[int, int, float]], *, name: str = "fitted") -> Link:
    """Fit alpha and 1/B of the ring model to measured ``(bytes, ranks, seconds)`` allreduces.

    Least squares on relative error (each equation divided by its measured time), so small
    messages, where latency dominates, weigh as much as large ones. Needs two distinct sizes.
    """
    rows = [(2 * (n - 1) / t, 2 * (n - 1) / n * b / t) for b, n, t in points if n > 1 and t > 0]
    # Normal equations of min sum (x1*alpha + x2*beta - 1)^2, with beta = 1/B.
    s11 = sum(x1 * x1 for x1, _ in rows)
    s12 = sum(x1 * x2 for x1, x2 in rows)
    s22 = sum(x2 * x2 for _, x2 in rows)
    r1 = sum(x1 for x1, _ in rows)
    r2 = sum(x2 for _, x2 in rows)
    det = s11 * s22 - s12 * s12
    if len(rows) < 2 or det <= 1e-12 * s11 * s22:
        raise BenchUsageError(
            "the allreduce measurement needs at least two different "
            "message sizes on 2+ ranks to fit latency and bandwidth"
        )
    alpha = (r1 * s22 - r2 * s12) / det
    beta = (s11 * r2 - s12 * r1) / det
    # Timings too noisy to show a bandwidth: fall back to the largest message's busbw
    if beta <= 0:
        b, n, t = max(points, key=lambda p: p[0])
        beta = t / (2 * (n - 1) / n * b)
    return Link(bandwidth=1 / beta, latency=max(alpha, 0.0), name=name)


def assign_buckets(params: Sequence[Param], *, cap_mb: float | None) -> list[Bucket]:
    """The buckets DDP rebuilds after its first iteration, for ``bucket_cap_mb = cap_mb``.

    Gradients in the order they became ready are packed greedily, one open bucket per dtype; a
    bucket closes once it holds at least its limit (so one large tensor may exceed it): the first
    limit is 1 MiB when ``cap_mb`` is None (torch's default, then 25 MiB), else ``cap_mb``. A
    bucket is launched when its last gradient is ready and every earlier bucket was launched.
    """
    cap = int((DEFAULT_BUCKET_CAP_MB if cap_mb is None else cap_mb) * MIB)
    limits = [DEFAULT_FIRST_BUCKET_BYTES if cap_mb is None else cap, cap]
    # Dtype -> [bytes, ready_s, limit index]
    open_buckets: dict[str, list[float]] = {}
    closed: list[tuple[float, float]] = []
    for p in sorted(params, key=lambda q: q.ready_s):
        bucket = open_buckets.setdefault(p.dtype, [0, 0.0, 0])
        bucket[0] += p.nbytes
        bucket[1] = max(bucket[1], p.ready_s)
        if bucket[0] >= limits[min(int(bucket[2]), 1)]:
            closed.append((bucket[0], bucket[1]))
            open_buckets[p.dtype] = [0, 0.0, bucket[2] + 1]
    closed.extend((b[0], b[1]) for b in open_buckets.values() if b[0])
    launched = 0.0
    out = []
    for nbytes, ready in closed:
        launched = max(launched, ready)
        out.append(Bucket(int(nbytes), launched))
    return out


def comm_end_s(
    buckets: Sequence[Bucket], n: int, link: Link, algorithm: Algorithm = "ring", *, comm_factor: float = 1.0
) -> tuple[float, float]:
    """``(end of the last allreduce, sum of allreduce times)``, seconds after backward began.

    Bucket ``i`` starts at ``max(ready_i, end_{i-1})``: DDP launches buckets in order and the
    collectives of one process group run one after another.
    """
    end = 0.0
    total = 0.0
    for bucket in buckets:
        cost = allreduce_s(bucket.nbytes * comm_factor, n, link, algorithm)
        end = max(end, bucket.ready_s) + cost
        total += cost
    return end, total


def straggler_s(samples: Sequence[float], n: int) -> float:
    """How much longer the median step of ``n`` ranks waits for its slowest rank than one rank's median.

    A synchronous allreduce ends when the last rank has joined it, so each step lasts as long as
    the slowest of ``n`` ranks' compute. With the per-iteration times ``samples`` of one rank as
    the distribution ``F`` of every rank's (independent) compute, the median of the maximum of
    ``n`` draws is ``F^-1(0.5^(1/n))``: the 71st percentile for 2 ranks, the 79th for 3, the
    99.9th for 1,024. Empirical quantiles, linearly interpolated, cannot go beyond the largest
    sample, so at large ``n`` this is a lower bound: a tail rarer than one in ``len(samples)``
    iterations is not seen. No samples (an assumed profile) means no spread: 0.
    """
    if n <= 1 or len(samples) < 2:
        return 0.0
    ordered = sorted(samples)
    return _quantile(ordered, 0.5 ** (1 / n)) - _quantile(ordered, 0.5)


def _quantile(ordered: Sequence[float], q: float) -> float:
    """The ``q`` quantile of sorted values, linear between order statistics (numpy's default)."""
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def predict(
    profile: Profile, n: int, link: Link, algorithm: Algorithm = "ring", *, buckets: Sequence[Bucket] | None = None
) -> Prediction:
    """Step time, samples/s and efficiency at ``n`` ranks (``buckets``: other than the measured ones)."""
    if n == 1:
        step = profile.single_step_s
        return Prediction(1, step, 0.0, 0.0, profile.batch_size / step, 1.0)
    end, total = comm_end_s(
        buckets if buckets is not None else profile.buckets, n, link, algorithm, comm_factor=profile.comm_factor
    )
    compute = profile.data_s + profile.forward_s + profile.optimizer_s + profile.local_backward_s
    wait = straggler_s(profile.step_samples_s, n)
    step = compute + broadcast_s(profile.buffer_bytes, n, link) + max(profile.backward_s, end) + wait
    return Prediction(
        n,
        step,
        total,
        max(0.0, end - profile.backward_s),
        n * profile.batch_size / step,
        profile.single_step_s / step,
        wait,
    )


def assumed_profile(
    step_s: float,
    grad_bytes: int,
    *,
    batch_size: int,
    backward_share: float = 2 / 3,
    cap_mb: float | None = None,
    pieces: int = 200,
) -> Profile:
    """A profile from published numbers instead of a measurement (what-if studies, published checks).

    ``step_s`` is one device's whole step; ``backward_share`` of it is the backward, the rest
    forward (data and optimizer counted in it). Gradients become ready at a constant rate in
    bytes over the backward (``pieces`` equal tensors): an assumption; real models front-load or
    back-load their bytes.
    """
    backward = step_s * backward_share
    params = tuple(Param(grad_bytes // pieces, backward * (i + 1) / pieces) for i in range(pieces))
    return Profile(
        batch_size=batch_size,
        data_s=0.0,
        forward_s=step_s - backward,
        backward_s=backward,
        optimizer_s=0.0,
        local_backward_s=0.0,
        single_step_s=step_s,
        buckets=tuple(assign_buckets(params, cap_mb=cap_mb)),
        params=params,
        bucket_cap_mb=cap_mb,
    )


def best_bucket_cap(
    profile: Profile, n: int, link: Link, *, caps_mb: Sequence[float], algorithm: Algorithm = "ring"
) -> tuple[float, Prediction]:
    """The ``bucket_cap_mb`` among ``caps_mb`` with the shortest predicted step (needs ``profile.params``)."""
    options = [
        (cap, predict(profile, n, link, algorithm, buckets=assign_buckets(profile.params, cap_mb=cap)))
        for cap in caps_mb
    ]
    return min(options, key=lambda option: option[1].step_s)


_BANDWIDTH = re.compile(r"^(\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)\s*([kKmMgGtT]?)(bit|Bit|b|B|bE|BE)(/s|ps)?$")
_LATENCY = re.compile(r"^\s*(\d+(?:\.\d+)?(?:e[+-]?\d+)?)\s*(ns|us|µs|ms|s)\s*$", re.IGNORECASE)
_SCALE = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_bandwidth(text: str, *, option: str = "--link") -> float:
    """Bytes/s in ``100Gbit`` or ``100Gb`` (bits), ``25GbE`` (Ethernet, bits), ``12.5GB/s`` or ``12.5GBps`` (bytes);
    decimal prefixes."""
    match = _BANDWIDTH.match(text.strip())
    if match is None or float(match.group(1)) <= 0:
        raise BenchUsageError(
            f"{option}: cannot read {text!r} as a positive bandwidth; write e.g. "
            "100Gbit, 25GbE or 12.5GB/s (decimal units; b = bits, B = bytes)"
        )
    number = float(match.group(1))
    prefix = match.group(2).lower()
    unit = match.group(3)
    # GB/s; everything else (bit, b, bE as in GbE) counts bits
    in_bytes = unit == "B"
    return number * _SCALE[prefix] / (1 if in_bytes else 8)


def parse_latency(text: str, *, option: str = "--latency") -> float:
    """Seconds in ``5us``, ``0.5ms``, ``800ns`` or ``1e-5s``."""
    match = _LATENCY.match(text)
    if match is None:
        raise BenchUsageError(f"{option}: cannot read {text!r} as a latency; write e.g. 5us, 0.5ms or 800ns")
    unit = match.group(2).lower().replace("µ", "u")
    return float(match.group(1)) * {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}[unit]
