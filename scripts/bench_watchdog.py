"""What the hang watchdog costs the training thread per step, measured without the step's own noise.

    python scripts/bench_watchdog.py                 # 7 rounds of 20000 loop skeleton steps each
    python scripts/bench_watchdog.py --rounds 3 --steps 5000

One step of the Trainer's loop announces four phases through ``Reporter.span`` (data, forward,
backward, optimizer). This runs that skeleton (four spans around no work) in one process, in
alternating rounds:

* ``off``: no phase listener, as with ``dist.hang_timeout: null`` (``Reporter.span`` returns the
  timeline's shared no-op context);
* ``on``: the watchdog's ``on_phase`` listening, and its daemon thread running: publishing a
  heartbeat to a store twice a second, sampling the main thread's stack, reading the (here absent)
  other rank's heartbeat. The store is an in-process ``HashStore``; with torchrun's TCPStore the
  I/O happens on the watchdog's own threads and connection, not the training thread's.

It prints the median per-step time of each and the difference in microseconds per step: the whole
per-step price of the watchdog, to compare with a step's duration (milliseconds even for a tiny
MLP; see ``scripts/bench_overhead.py``, which runs the real Trainer with the watchdog on).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ddpkit.checkpoint.state import Progress
from ddpkit.config.loader import load_config
from ddpkit.distributed.env import DistEnv
from ddpkit.distributed.process_group import Runtime
from ddpkit.faults.watchdog import Watchdog
from ddpkit.reporting.reporter import Reporter

PHASES = ("data", "forward", "backward", "optimizer")


def skeleton(reporter: Reporter, steps: int) -> float:
    """Seconds per step of ``steps`` steps that do nothing but announce their phases."""
    span = reporter.span
    start = time.perf_counter()
    for _ in range(steps):
        for phase in PHASES:
            with span(phase):
                pass
    return (time.perf_counter() - start) / steps


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20000)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config({"run": {"output_dir": tmp}, "log": {"progress_bar": False}})
        runtime = Runtime(env=DistEnv(rank=0, local_rank=0, world_size=2, local_world_size=2), device=torch.device("cpu"), backend="gloo")
        plain = Reporter(cfg, runtime=runtime, total_steps=1, progress=Progress(), resumed=False)
        watched = Reporter(cfg, runtime=runtime, total_steps=1, progress=Progress(), resumed=False)
        # A limit no round reaches: the absent rank 1 must not end the benchmark as a "hang".
        watchdog = Watchdog(dist.HashStore(), rank=0, world_size=2, hang_timeout=1e6, slow_timeout=1e6, log_dir=Path(tmp), step=lambda: 0)
        watchdog.listen_to(watched)
        times: dict[str, list[float]] = {"off": [], "on": []}
        with watchdog:
            for r in range(args.rounds):
                for name in (("off", "on") if r % 2 == 0 else ("on", "off")):
                    times[name].append(skeleton(plain if name == "off" else watched, args.steps))
        for reporter in (plain, watched):
            reporter.close("FINISHED")
    off, on = (statistics.median(times[k]) * 1e6 for k in ("off", "on"))
    print(f"{args.rounds} rounds x {args.steps} steps of {len(PHASES)} spans each (median per step):")
    print(f"  watchdog off: {off:.2f} us/step")
    print(f"  watchdog on:  {on:.2f} us/step")
    print(f"  cost: {on - off:+.2f} us/step")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
