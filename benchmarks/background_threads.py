"""What ddpkit's background threads cost while a run trains: CPU seconds per second of training, by thread.

    python -m benchmarks.background_threads                  # the MLP, 2 Gloo ranks, every default on, ~20 s
    python -m benchmarks.background_threads --seconds 60 --workload mnist_cnn

Each rank trains the ``benchmarks.workloads`` job through the Trainer with its defaults (hang watchdog, stop
poll, run lock refresh, memory snapshots, crash save, trackers off), then reads every live thread's CPU time
from ``/proc/self/task/<tid>/stat`` (user + system, the kernel's own accounting: time spent waiting or sleeping
costs nothing) and divides it by the training's wall time. The training thread is listed for scale. On a
2-core machine, a background thread's share of a core is time the training threads of both ranks compete for.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import ddpkit
from benchmarks.workloads import WORKLOADS, load_printed, table, trainer_config
from ddpkit.testing import run_on_ranks

_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(native_id: int) -> float:
    fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime (fields 14, 15 of stat)


class _Measured(ddpkit.Trainer):
    """Notes each thread's CPU time when training starts and after its last step (the threads still run)."""

    def on_fit_start(self) -> None:
        self.started, self.before = time.perf_counter(), self._threads()

    def on_step_end(self, step: int) -> None:
        if step == self.total_steps:
            self.wall = time.perf_counter() - self.started
            self.after = self._threads()

    @staticmethod
    def _threads() -> dict[str, float]:
        found = {}
        for thread in threading.enumerate():
            try:
                found[thread.name] = found.get(thread.name, 0.0) + _cpu_seconds(thread.native_id)
            except (OSError, TypeError):
                continue  # it ended meanwhile
        return found


def _rank(workload: str, steps: int, out: str) -> dict[str, Any]:
    w = WORKLOADS[workload]
    trainer = _Measured(trainer_config(w, steps, 2, out, name="threads", log={"progress_bar": False}))
    trainer.fit()
    shares = {
        name: (trainer.after.get(name, 0.0) - trainer.before.get(name, 0.0)) / trainer.wall for name in trainer.after
    }
    return {"wall": trainer.wall, "shares": shares}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="mlp", choices=sorted(WORKLOADS))
    parser.add_argument("--steps", type=int, default=3000, help="optimizer steps (default 3000: ~20 s of the MLP here)")
    args = parser.parse_args()
    with load_printed(), tempfile.TemporaryDirectory() as out:
        ranks = run_on_ranks(_rank, 2, args=(args.workload, args.steps, out), timeout=3600)
    names = sorted({name for r in ranks for name in r["shares"]}, key=lambda n: -ranks[0]["shares"].get(n, 0.0))
    rows = [[name, *(f"{100 * r['shares'].get(name, 0.0):.3f}%" for r in ranks)] for name in names]
    title = (
        f"{args.workload}, 2 Gloo ranks, {args.steps} steps, every default on: CPU time per second of training "
        f"(wall {ranks[0]['wall']:.1f} s)"
    )
    print(table(title, ["thread", "rank 0", "rank 1"], rows))


if __name__ == "__main__":
    main()
