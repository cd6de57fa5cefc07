"""Names a rank that is consistently slower than the others at its own work.

    watch = StragglerWatch(config.health.straggler, parameters=model.parameters(), rank=0, world_size=2, device=device)
    events.add(watch)            # on_phase: the data span starts and ends (its phases, OWN_WORK)
    ...
    message = watch.step_done()                  # every step; every `every` steps one small all_reduce

Own work per step is this rank's data wait (the data span) and its compute: from the batch in hand
to its *last gradient ready*, i.e. forward and backward without the wait for the other ranks (a
post-accumulate-grad hook notes the time: on every parameter during the first step, which finds
the parameter whose gradient comes last, then on that one only). Backward wall time alone cannot
tell: DDP waits for the all-reduce at the end of backward, which makes every rank's backward as long
as the slowest rank's. Two clock reads per micro-batch and one per gradient hook: the forward and
backward spans need no listener. Each rank keeps its per-step times over a window of ``every`` steps
and takes their median, so a burst of noise (a descheduled process on a busy machine) that covers
less than half the window does not count. A rank whose median exceeds the other ranks' median by
``margin`` in ``windows`` consecutive windows is named, on rank 0, as

    straggler: rank 1 is 38% slower than the median rank over the last 50 steps (data 2.0 ms, compute 31.0 ms)

On CUDA the times are the host's (kernel launches are asynchronous): a rank whose GPU is slow shows
up through its data wait only. The CPU and the host side of a GPU job are measured exactly.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable

import torch

from ddpkit.config.health_section import StragglerConfig
from ddpkit.distributed.collectives import all_reduce_sum
from ddpkit.training.health_checks import slower_ranks

__all__ = ["StragglerWatch", "OWN_WORK"]

#: A rank is named only when it is also this much slower a step, in seconds: below a millisecond a step
#: the gap is scheduling noise on a shared machine (a balanced run of sub-millisecond steps showed
#: "32% slower": 0.6 against 0.45 ms), and never worth a warning.
MIN_GAP_S = 1e-3

#: The spans this watch listens to: the data wait; compute runs from its end to the last gradient.
OWN_WORK = ("data",)


class StragglerWatch:
    """Per-step own-work times on this rank; a comparison across ranks every ``cfg.every`` steps."""

    def __init__(
        self,
        cfg: StragglerConfig,
        *,
        parameters: Iterable[torch.nn.Parameter],
        rank: int,
        world_size: int,
        device: torch.device,
        peers: int | None = None,
    ):
        """``peers``: how many neighbouring ranks do the same work and are compared with one another (under a
        pipeline, the ranks of one stage; by default every rank)."""
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.peers = peers or world_size
        self._started = self._data_end = self._grad_ready = 0.0
        #: This step so far, seconds.
        self._data = self._compute = 0.0
        #: (data, compute) per step of the window.
        self._steps: list[tuple[float, float]] = []
        self._slow_windows = [0] * world_size
        #: The rank named at the last comparison and how much slower.
        self.named: tuple[int, float] | None = None
        self._parameters = [p for p in parameters if p.requires_grad]
        #: The first step's last gradient: the one hook kept after it.
        self._last_ready: torch.Tensor | None = None
        self._hooks = [p.register_post_accumulate_grad_hook(self._first_step_gradient) for p in self._parameters]

    def _first_step_gradient(self, param: torch.Tensor) -> None:
        self._grad_ready = time.perf_counter()
        self._last_ready = param

    def _gradient_ready(self, _param: torch.Tensor) -> None:
        """The micro-batch's last gradient is ready: its forward and backward compute ends here."""
        now = time.perf_counter()
        self._compute += now - self._data_end
        # A pipeline's M microbatches end their backwards after one data span: each adds only its own stretch
        self._data_end = now

    def _keep_one_hook(self) -> None:
        """After the first step: hook only the parameter whose gradient came last (a Python call per step, not per
        parameter)."""
        self.close()
        if self._last_ready is not None:
            self._hooks = [self._last_ready.register_post_accumulate_grad_hook(self._gradient_ready)]
        self._parameters = []
        self._last_ready = None

    #: The spans :meth:`on_phase` hears (see :class:`ddpkit.reporting.events.Events`).
    phases = OWN_WORK

    def on_phase(self, name: str | None) -> None:
        """A listener of the data span: ``"data"`` as it starts, None as it ends."""
        now = time.perf_counter()
        if name is not None:
            self._started = now
        else:
            self._data += now - self._started
            self._data_end = now

    def step_done(self) -> str | None:
        """Close this step's times; at the end of a window compare ranks (a collective) and return a message, if any."""
        # The first step: every gradient was hooked; its last micro-batch's compute counts.
        if self._parameters:
            self._compute += max(0.0, self._grad_ready - self._data_end)
            self._keep_one_hook()
        self._steps.append((self._data, self._compute))
        self._data = self._compute = 0.0
        if len(self._steps) < self.cfg.every:
            return None
        return self._compare()

    def _compare(self) -> str | None:
        own = statistics.median(d + c for d, c in self._steps)
        data = statistics.median(d for d, _ in self._steps)
        compute = statistics.median(c for _, c in self._steps)
        window = len(self._steps)
        self._steps = []
        table = torch.zeros(self.world_size, 3, dtype=torch.float64, device=self.device)
        table[self.rank] = torch.tensor([own, data, compute], dtype=torch.float64)
        # Every rank gets the same table, so every rank decides alike.
        rows = all_reduce_sum(table).tolist()
        slow = self._slower([row[0] for row in rows])
        self._slow_windows = [self._slow_windows[r] + 1 if r in slow else 0 for r in range(self.world_size)]
        named = [(r, slow[r]) for r in range(self.world_size) if self._slow_windows[r] >= self.cfg.windows]
        peer = "rank" if self.peers == self.world_size else "rank of its stage"
        self.named = max(named, key=lambda item: item[1]) if named else None
        return (
            "; ".join(
                f"straggler: rank {r} is {fraction:.0%} slower than the median {peer} over the last {window} steps "
                f"(data {rows[r][1] * 1e3:.1f} ms, compute {rows[r][2] * 1e3:.1f} ms per step)"
                for r, fraction in named
            )
            or None
        )

    def _slower(self, times: list[float]) -> dict[int, float]:
        """The slow ranks of ``times`` (one a rank) and how much slower, each compared with its peers only: the
        ranks of one pipeline stage are neighbours (the mesh puts the pipeline outermost), and stages do different
        work, so a stage's ranks are compared with one another, never with another stage's."""
        slow = {}
        for first in range(0, self.world_size, self.peers):
            peers = times[first : first + self.peers]
            slow.update({first + r: f for r, f in slower_ranks(peers, margin=self.cfg.margin, floor=MIN_GAP_S)})
        return slow

    def close(self) -> None:
        """Remove the gradient hooks."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
