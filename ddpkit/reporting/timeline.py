"""A Chrome-trace timeline of the training loop, one row per rank.

With ``train.timeline: true`` every rank records spans (data wait, forward, backward with the
gradient allreduce, optimizer, checkpoint, evaluation); at the end rank 0 gathers them and
writes ``<output_dir>/timeline.json``. Open it in https://ui.perfetto.dev or chrome://tracing:
each rank is a row on one shared clock, so a straggler rank (long data waits, or short ones
followed by long backward passes while it waits for the others) is visible at a glance.

Off (the default), ``span()`` returns one shared no-op context manager: nothing is recorded.
On CUDA, spans end with ``torch.cuda.synchronize()`` so they show GPU time, not launch time;
that is the timeline's overhead there. On the CPU the overhead is two clock reads per span.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from ddpkit.atomic import write_atomically
from ddpkit.distributed.collectives import all_gather_object

__all__ = ["Timeline"]

_OFF = contextlib.nullcontext()


class _Span:
    __slots__ = ("timeline", "name", "start")

    def __init__(self, timeline: Timeline, name: str):
        self.timeline = timeline
        self.name = name

    def __enter__(self) -> None:
        self.start = time.time_ns()

    def __exit__(self, *exc: object) -> None:
        if self.timeline.cuda:
            torch.cuda.synchronize()
        self.timeline.events.append((self.name, self.start, time.time_ns()))


class Timeline:
    """Records named spans on this rank; :meth:`write` merges all ranks into one trace file."""

    def __init__(self, *, enabled: bool, rank: int, device: torch.device, max_events: int = 200_000):
        self.enabled = enabled
        self.rank = rank
        self.max_events = max_events
        self.cuda = device.type == "cuda"
        self.events: list[tuple[str, int, int]] = []

    def span(self, name: str) -> contextlib.AbstractContextManager[Any]:
        """Context manager timing ``name``; free when the timeline is off or full."""
        if not self.enabled or len(self.events) >= self.max_events:
            return _OFF
        return _Span(self, name)

    def extend(self, spans: list[tuple[str, int, int]]) -> None:
        """Spans timed elsewhere, as ``(name, start_ns, end_ns)`` on ``time.time_ns``'s clock (a pipeline stage's
        compute inside torch's schedule); nothing when the timeline is off or full."""
        if self.enabled and len(self.events) < self.max_events:
            self.events.extend(spans)

    def write(self, path: str | os.PathLike) -> Path | None:
        """Gather every rank's spans (a collective) and, on rank 0, write the merged trace to ``path``."""
        if not self.enabled:
            return None
        per_rank = all_gather_object(self.events)
        if self.rank != 0:
            return None
        start = min((ev[1] for events in per_rank for ev in events), default=0)
        trace: list[dict[str, Any]] = []
        for rank, events in enumerate(per_rank):
            trace.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}})
            trace.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": rank, "args": {"sort_index": rank}})
            trace.extend(
                {
                    "name": name,
                    "cat": "train",
                    "ph": "X",
                    "pid": 0,
                    "tid": rank,
                    "ts": (begin - start) / 1000,
                    "dur": (end - begin) / 1000,
                }
                for name, begin, end in events
            )
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}))
        return path
