"""One gradient bucket layout for every DDP step, so a resumed run adds gradients in the same order.

    ddp = DDP(model, ...)
    pin_bucket_layout(ddp, options)     # before the first backward; a no-op where DDP never rebuilds

Why it is needed. DDP all-reduces gradients in flat buckets. For its first iteration it puts every
parameter in one bucket (it cannot know yet in which order gradients become ready), records that
order during the first backward, and rebuilds its buckets from it before the second forward
(``bucket_cap_mb``-sized, in ready order). A resumed run builds a new DDP, so its first step
reduces in the one-bucket layout where the uninterrupted run, at the same step, used the rebuilt
one. The ring all-reduce adds each element's contributions in an order set by the element's
position in the flat buffer, so another layout is another order of summation: on 2 ranks
``a + b == b + a`` hides it; on 3 ranks and more the resumed weights drift by an ulp from that
step on (about 1e-7 after 30 steps).

What this does. A DDP communication hook (torch's public ``register_comm_hook``) that always
reduces in the rebuilt layout:

- during the first synced backward, post-accumulate-grad hooks note the order in which gradients
  become ready: the order DDP's own reducer records from the same autograd nodes;
- when the first (one-bucket) iteration hands its bucket over, the hook computes the layout DDP
  is about to rebuild, with torch's own ``_compute_bucket_assignment_by_size`` and DDP's limits,
  and all-reduces the big bucket piece by piece in that layout;
- from then on every bucket DDP hands over is one of those pieces: it is divided by the world
  size and all-reduced as it is, exactly what torch's ``allreduce_hook`` (and ``fp16`` / ``bf16``
  compression: ``fp16_compress_hook``) do.

So a step's sums depend only on the rebuilt layout, the same in a fresh and in a resumed process.

What it costs. The first iteration copies every gradient once more (into the pieces and back).
Afterwards the hook is torch's ``allreduce_hook``: one Python call per bucket, and the division
by the world size as its own pass over the bucket where DDP's built-in path folds it into the
copy into the bucket (one more read and write of the gradients: about 0.3 ms for GPT-2 124M's
0.5 GB on an H100, against a step of 140 ms).

Where it does not apply. Two replicas: each element's sum is ``a + b`` in any layout, so the pin would cost
(about 0.1 ms a step on a 3 ms CPU step, measured with ``benchmarks.trees``) and change nothing; it starts at
three. ``find_unused_parameters=true`` never rebuilds (its layout is fixed from
the start, at the cost of a graph traversal every step), so nothing is pinned. PowerSGD keeps an
error-feedback state per bucket that no checkpoint holds; a resumed PowerSGD run is not bitwise
on any number of ranks, so it is left as torch has it.
"""

# No `from __future__ import annotations`: DDP's register_comm_hook checks the hook's annotations as objects.
import logging

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit.config.schema import DDPConfig

__all__ = ["pin_bucket_layout", "PinnedLayout"]

log = logging.getLogger(__name__)

# torch's DDP: a first bucket of 1 MiB when bucket_cap_mb is left at its default
# (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES), else every bucket at bucket_cap_mb.
_DEFAULT_BUCKET_CAP_MB = 25
_COMPRESSED = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def pin_bucket_layout(ddp: DDP, options: DDPConfig) -> "PinnedLayout | None":
    """Register the pinning hook on ``ddp`` (before its first backward); None where no layout moves.

    ``options.comm_hook`` ``none``, ``fp16`` and ``bf16`` are pinned (the hook compresses as torch's
    hooks do); ``powersgd`` and ``find_unused_parameters`` are left to torch (see the module docstring).
    """
    if options.find_unused_parameters or options.comm_hook not in _COMPRESSED:
        return None
    # Two replicas add a + b == b + a in any layout: torch's built-in C++ path stays (no Python call per bucket).
    if dist.get_world_size(ddp.process_group) <= 2:
        return None
    state = PinnedLayout(ddp, bucket_cap_mb=options.bucket_cap_mb, compress=_COMPRESSED[options.comm_hook])
    ddp.register_comm_hook(state, _pinned_allreduce_hook)
    return state


class PinnedLayout:
    """The hook's state: the parameters by index, their ready order, and the layout DDP rebuilds to."""

    def __init__(self, ddp: DDP, *, bucket_cap_mb: float | None, compress: torch.dtype | None):
        self.group = ddp.process_group
        self.world_size = dist.get_world_size(self.group)
        self.compress = compress
        self.params = [p for p in ddp.module.parameters() if p.requires_grad]
        self.index = {id(p): i for i, p in enumerate(self.params)}
        cap = int((bucket_cap_mb if bucket_cap_mb is not None else _DEFAULT_BUCKET_CAP_MB) * 1024 * 1024)
        first = dist._DEFAULT_FIRST_BUCKET_BYTES if bucket_cap_mb is None else cap
        self.limits = [first, cap]
        # The layout DDP rebuilds to, as lists of parameter indices: known after the first synced backward.
        self.layout: list[list[int]] | None = None
        # True once every bucket of one iteration was found in the layout: then buckets go straight through.
        self.verified = False
        self._seen: set[int] = set()
        self._ready: list[int] = []
        self._recorders = [p.register_post_accumulate_grad_hook(self._record) for p in self.params]

    def _record(self, param: torch.Tensor) -> None:
        index = self.index[id(param)]
        # A parameter seen twice starts another backward (an accumulation micro-step before the
        # synced one): only the order of the latest backward counts.
        if index in self._seen:
            self._seen.clear()
            self._ready.clear()
        self._seen.add(index)
        self._ready.append(index)

    def plan(self) -> list[list[int]]:
        """The layout DDP rebuilds to from this backward's ready order (its own function and limits)."""
        for handle in self._recorders:
            handle.remove()
        self._recorders = []
        tensors = [self.params[i] for i in self._ready]
        layout, _ = dist._compute_bucket_assignment_by_size(tensors, self.limits, [False] * len(tensors), self._ready)
        return [list(bucket) for bucket in layout]

    def reduce(self, flat: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        """``flat`` averaged over the ranks in place, as torch's allreduce and compression hooks do."""
        if self.compress is None:
            # A multiplication by 1 / world_size, as DDP's built-in path scales gradients into its buckets.
            flat.mul_(1.0 / self.world_size)
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            return work.get_future().then(lambda fut: fut.value()[0])
        compressed = flat.to(self.compress).div_(self.world_size)
        work = dist.all_reduce(compressed, group=self.group, async_op=True)
        return work.get_future().then(lambda fut: flat.copy_(fut.value()[0]))


def _pinned_allreduce_hook(state: PinnedLayout, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    if state.verified:
        return state.reduce(buffer)
    if state.layout is None:
        state.layout = state.plan()
    indices = [state.index[id(p)] for p in bucket.parameters()]
    if indices in state.layout:
        if bucket.is_last():
            state.verified = True
        return state.reduce(buffer)
    pieces = _pieces_of(indices, state.layout)
    if pieces is None:
        # DDP's buckets are not the predicted ones (a torch whose rebuild differs): reduce as they come.
        log.warning(
            "DDP's gradient buckets differ from the layout ddpkit predicted: a resumed run on 3 or "
            "more ranks may differ from an uninterrupted one by an ulp; please report your torch version"
        )
        state.verified = True
        return state.reduce(buffer)
    return _reduce_in_pieces(state, buffer, indices, pieces)


def _pieces_of(indices: list[int], layout: list[list[int]]) -> "list[list[int]] | None":
    """The layout's buckets that make up exactly the parameters ``indices``, or None if they do not."""
    wanted = set(indices)
    pieces = [bucket for bucket in layout if wanted.issuperset(bucket)]
    if sum(len(piece) for piece in pieces) != len(indices):
        return None
    return pieces


def _reduce_in_pieces(
    state: PinnedLayout, buffer: torch.Tensor, indices: list[int], pieces: list[list[int]]
) -> torch.futures.Future[torch.Tensor]:
    """All-reduce one large bucket as the pieces of the layout, each laid out as DDP will lay it out."""
    views: dict[int, torch.Tensor] = {}
    offset = 0
    for index in indices:
        numel = state.params[index].numel()
        views[index] = buffer.narrow(0, offset, numel)
        offset += numel
    flats = [torch.cat([views[i] for i in piece]) for piece in pieces]
    futures = [state.reduce(flat) for flat in flats]

    def copy_back(_: torch.futures.Future) -> torch.Tensor:
        for piece, flat in zip(pieces, flats):
            start = 0
            for index in piece:
                numel = views[index].numel()
                views[index].copy_(flat.narrow(0, start, numel))
                start += numel
        return buffer

    return torch.futures.collect_all(futures).then(copy_back)
