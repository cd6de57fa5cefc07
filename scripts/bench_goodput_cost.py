"""The step path's price for goodput, measured in one process (used by ``bench_goodput.py cost``).

    .venv/bin/python scripts/bench_goodput.py cost --rounds 5

Per round, alternating: 200 MLP optimizer steps (the chaos run's model and batch) bare, and the
same steps also calling the span listeners the Trainer calls (the goodput ledger's and the crash
save's: 8 span events per step, two RNG copies each also written to the rank's shared-memory slot
file, as the update ends and at the boundary). Then one memory snapshot's blocking part
(state_dict of model and optimizer, copied to new CPU tensors). Prints medians and ratios.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn
from torch.nn import functional as F

from ddpkit.checkpoint.components import Progress
from ddpkit.checkpoint.files import to_cpu
from ddpkit.faults.boundary_rng import BoundarySlots
from ddpkit.faults.goodput import GoodputLedger
from ddpkit.faults.recovery import CrashSave

SPANS = ("data", None, "forward", None, "backward", None, "optimizer", None)


def _listeners(progress: Progress) -> list:
    ledger = GoodputLedger(None, step=lambda: progress.step)
    crash = CrashSave.__new__(CrashSave)
    crash.state, crash.boundary, crash._clean = SimpleNamespace(progress=progress), None, True
    crash._updating, crash._updated_rng = False, None
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    crash._slots = BoundarySlots.create(shm / f"bench-goodput-{os.getpid()}.rng", torch.get_rng_state().numel())
    os.unlink(crash._slots.path)  # the mapping stays; nothing is left behind
    return [ledger.on_phase, crash.on_phase]


def _steps(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, n: int, listeners: list, progress: Progress) -> float:
    began = time.perf_counter()
    for _ in range(n):
        for span in SPANS[:6]:
            for listen in listeners:
                listen(span)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        for span in SPANS[6:]:
            for listen in listeners:
                listen(span)
        opt.step()
        opt.zero_grad()
        progress.step += 1
    return (time.perf_counter() - began) / n


def _spans_only(listen, progress: Progress, n: int) -> float:
    began = time.perf_counter()
    for _ in range(n):
        for span in SPANS:
            listen(span)
        progress.step += 1
    return (time.perf_counter() - began) / n


def slot_cost(*, rounds: int, n: int = 20000) -> None:
    """The crash save's listener alone, with and without its slot file: the slot writes' own price, free of the step's noise."""
    progress = Progress()
    with_file = _listeners(progress)[1]
    without = _listeners(progress)[1]
    without.__self__._slots = None
    runs: dict[str, list[float]] = {"without": [], "with": []}
    for r in range(rounds):
        for name in ("without", "with") if r % 2 == 0 else ("with", "without"):
            runs[name].append(_spans_only(with_file if name == "with" else without, progress, n))
    a, b = statistics.median(runs["without"]), statistics.median(runs["with"])
    print(f"crash-save listener, 8 spans a step (median of {rounds} rounds x {n}): {a * 1e6:.2f} us without slot files, {b * 1e6:.2f} us with")


def measure(*, rounds: int, steps: int = 200) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Flatten(), nn.Linear(144, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = torch.randn(32, 144), torch.randint(0, 10, (32,))
    progress = Progress()
    bare, listened, snaps = [], [], []
    _steps(model, opt, x, y, 50, [], progress)  # warm-up
    for r in range(rounds):
        pair = [("bare", []), ("listened", _listeners(progress))]
        for name, listeners in pair if r % 2 == 0 else reversed(pair):
            (bare if name == "bare" else listened).append(_steps(model, opt, x, y, steps, listeners, progress))
        began = time.perf_counter()
        to_cpu({"model": model.state_dict(), "optimizer": opt.state_dict()})
        snaps.append(time.perf_counter() - began)
    step, with_listeners, snap = statistics.median(bare), statistics.median(listened), statistics.median(snaps)
    print(f"MLP step (median of {rounds} rounds x {steps} steps): {step * 1e6:.0f} us bare, {with_listeners * 1e6:.0f} us with the listeners")
    print(f"per-step cost: {(with_listeners - step) * 1e6:+.1f} us = {with_listeners / step - 1:+.2%} of the step (paired ratio median "
          f"{statistics.median(b / a for a, b in zip(bare, listened)) - 1:+.2%})")
    slot_cost(rounds=rounds)
    print(f"memory snapshot, blocking part: {snap * 1e6:.0f} us = {snap / step:.1f} steps; every K steps costs {snap / step:.1f}/K of a step")
