"""What each piece of the Trainer's per-step work costs, in microseconds, on the MLP's step.

    python scripts/bench_step_parts.py                 # 7 alternating rounds of 300 steps
    python scripts/bench_step_parts.py --rounds 11 --steps 500

One process, one thread, the benchmark MLP (784-128-128-10, batch 64, SGD with momentum): the
plain step (forward, cross-entropy, backward, ``optimizer.step``, ``zero_grad``) and the same step
with one piece of ddpkit's per-step work added, each piece exactly as the Trainer runs it:

* ``nan guard``: ``loss * (loss.detach() * 0 + 1)``, which makes a non-finite loss's gradients
  non-finite on every rank after the all-reduce (:meth:`TrainingHealth.watch_loss` off the CPU);
* ``nan check (host read)``: what ``watch_loss`` does with a CPU loss instead: reads it and
  multiplies by NaN only when it is not finite;
* ``grad norm``: :func:`ddpkit.distributed.sharding.gradient_norm` and its one host read;
* ``straggler hooks``: a post-accumulate-grad hook per parameter noting when the last gradient is
  ready (:class:`ddpkit.training.straggler.StragglerWatch`);
* ``rng boundary``: :class:`ddpkit.faults.recovery.CrashSave`'s two ``torch.get_rng_state()``
  copies and two slot writes (:class:`ddpkit.faults.boundary_rng.BoundarySlots`);
* ``spans``: the four ``reporter.span()`` contexts of a step with the default phase listeners
  (watchdog, goodput ledger, crash save, memory snapshots, straggler watch) subscribed to the
  spans each asks for; stand-ins that do what each real listener does on the step path.

Rounds alternate the variants (each round runs all of them, in a rotated order); the cost of a
piece is the paired median, over rounds, of (variant - plain) in thread-CPU microseconds per step.
It measures the code, not the machine's mood: record the load average next to the numbers.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ddpkit.distributed.sharding import gradient_norm
from ddpkit.faults.boundary_rng import BoundarySlots
from ddpkit.registry import MODELS
from ddpkit.reporting.reporter import _PhaseSpan

BATCH = 64


class Listeners:
    """Stand-ins for the five default phase listeners, doing on each span what the real ones do."""

    def __init__(self) -> None:
        self.phases, self.ticks, self.span, self.pending, self.updating, self.grad_ready = ["loop"], 0, [], False, False, 0.0
        self.started, self.phase, self.own = 0.0, None, 0.0

    def watchdog(self, name: str | None) -> None:
        if name is None:
            if len(self.phases) > 1:
                self.phases.pop()
        else:
            self.phases.append(name)
        self.ticks += 1

    def ledger(self, name: str | None) -> None:
        if name is not None:
            self.span.append(name)
            return
        if (self.span.pop() if self.span else None) == "optimizer":
            self.last = time.time()

    def crash(self, name: str | None) -> None:
        if name == "optimizer":
            self.updating = True
        elif name is None and self.updating:
            self.updating = False

    def snapshots(self, name: str | None) -> None:
        if name == "optimizer":
            self.pending = True
        elif name == "data" and self.pending:
            self.pending = False

    def straggler(self, name: str | None) -> None:
        now = time.perf_counter()
        if name is not None:
            self.phase, self.started = name, now
            return
        if self.phase in ("data", "forward", "backward"):
            self.own += now - self.started
        self.phase = None


def variants(model: torch.nn.Module, rng_file: Path) -> dict[str, Any]:
    """name -> (setup, step(x, y, optimizer)); every step does the plain work plus its piece."""
    params = list(model.parameters())
    slots = BoundarySlots.create(rng_file, torch.get_rng_state().numel())
    listeners = Listeners()
    subscribed = [  # each listener and the spans it asks for, as the Trainer registers them
        (listeners.watchdog, None), (listeners.ledger, ("optimizer",)), (listeners.crash, ("optimizer", "data")),
        (listeners.snapshots, ("optimizer", "data")), (listeners.straggler, ("data", "forward", "backward")),
    ]
    spans = {name: _PhaseSpan(name, tuple(f for f, names in subscribed if names is None or name in names))
             for name in ("data", "forward", "backward", "optimizer")}
    hooks: list[Any] = []
    step_no = [0]

    def plain(x, y, opt, *, guard=False, read=False, norm=False):
        loss = F.cross_entropy(model(x), y)
        if guard:
            detached = loss.detach()
            loss = loss * (detached * 0 + 1)
        if read and not math.isfinite(loss.detach().item()):
            loss = loss * math.nan
        loss.backward()
        if norm:
            float(gradient_norm(params))
        opt.step()
        opt.zero_grad(set_to_none=True)

    def rng(x, y, opt):
        step_no[0] += 1
        slots.write(step_no[0], torch.get_rng_state())
        plain(x, y, opt)
        slots.write(step_no[0], torch.get_rng_state(), final=False)

    def with_spans(x, y, opt):
        with spans["data"]:
            pass
        with spans["forward"]:
            loss = F.cross_entropy(model(x), y)
        with spans["backward"]:
            loss.backward()
        with spans["optimizer"]:
            opt.step()
            opt.zero_grad(set_to_none=True)

    def add_hooks():
        hooks.extend(p.register_post_accumulate_grad_hook(lambda _p: setattr(listeners, "grad_ready", time.perf_counter())) for p in params)

    def remove_hooks():
        for h in hooks:
            h.remove()
        hooks.clear()

    return {
        "plain": (None, None, plain),
        "nan guard": (None, None, lambda x, y, o: plain(x, y, o, guard=True)),
        "nan check (host read)": (None, None, lambda x, y, o: plain(x, y, o, read=True)),
        "grad norm": (None, None, lambda x, y, o: plain(x, y, o, norm=True)),
        "straggler hooks": (add_hooks, remove_hooks, plain),
        "rng boundary": (None, None, rng),
        "spans (5 listeners)": (None, None, with_spans),
    }


def time_variant(step: Any, model: torch.nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]], steps: int) -> float:
    """Thread-CPU microseconds per step over ``steps`` steps (after 20 warm-up steps)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for x, y in data[:20]:
        step(x, y, opt)
    started = time.thread_time()
    for i in range(steps):
        x, y = data[i % len(data)]
        step(x, y, opt)
    return (time.thread_time() - started) / steps * 1e6


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = MODELS.build("mlp", key="model.name", kwargs={"hidden": [128, 128]})
    data = [(torch.randn(BATCH, 1, 28, 28), torch.randint(0, 10, (BATCH,))) for _ in range(50)]
    print(f"load average before: {' '.join(f'{v:.2f}' for v in os.getloadavg())}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        table = variants(model, Path(tmp) / "rng")
        names = list(table)
        per: dict[str, list[float]] = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                setup, teardown, step = table[name]
                if setup:
                    setup()
                per[name].append(time_variant(step, model, data, args.steps))
                if teardown:
                    teardown()
    plain = per["plain"]
    print(f"\nMLP 784-128-128-10, batch {BATCH}, 1 thread, {args.rounds} rounds x {args.steps} steps; thread-CPU us/step")
    print("| piece | us/step (median) | extra us/step vs plain, paired median (min..max) | % of the plain step |")
    print("|---|---:|---:|---:|")
    base = statistics.median(plain)
    for name in names:
        extra = [v - p for v, p in zip(per[name], plain)]
        med = statistics.median(extra)
        spread = f"{min(extra):+.1f}..{max(extra):+.1f}" if name != "plain" else "-"
        print(f"| {name} | {statistics.median(per[name]):.1f} | {med:+.1f} ({spread}) | {100 * med / base:+.2f}% |")
    print(f"\nload average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
