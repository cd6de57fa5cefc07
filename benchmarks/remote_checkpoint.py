"""What remote checkpoints (``checkpoint.dir: s3://...``) cost the training loop, and how fast they upload.

    python -m benchmarks.remote_checkpoint                      # 16 MiB state, 80 steps, 3 rounds (about a minute)
    python -m benchmarks.remote_checkpoint --mb 256 --steps 200 --every 20 --warmup 40 --rounds 5

A local S3 server (moto's, ``pip install 'moto[server]'``) is started on 127.0.0.1 for the run. One
process runs a fixed CPU step (matrix products, about 20 ms) and saves its state every ``--every``
steps, two ways in alternating rounds (the order rotates each round), same state and steps:

* **local**: ``save_checkpoint`` into the staging folder, as without a URL;
* **remote**: the same save, then ``RemoteMirror.saved(path)``: the upload is queued to the mirror's
  background process, and the loop goes on.

Per variant, medians over rounds: **save ms** (the time a save holds the loop: the local write, plus
queueing the upload; **queue ms** is the queueing alone), **step ms** (the steps between saves, which an
upload in flight may slow by competing for the CPU) and the loop's wall time; for the remote variant,
the **upload MB/s** of a checkpoint (its bytes over the upload process's time for it) and how many
steps the bucket lagged at the end of the loop. The goal: a save holds the loop no longer than a local save does.

The first ``--warmup`` steps (and their saves) are left out: the mirror's upload process starts with it
(a new interpreter, about half a second), which a real run's setup (data, model) hides. moto's server runs
on the same machine, niced like the upload process (which lowers its own priority), as a stand-in for
a server elsewhere; on a loaded 2-core machine both still take CPU time from the loop.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch

from ddpkit.checkpoint.files import save_checkpoint
from ddpkit.checkpoint.storage import RemoteMirror
from ddpkit.config.loader import load_config
from ddpkit.distributed import DistEnv, Runtime

BUCKET = "bench"
_SERVE = (
    "import sys\nfrom moto.server import ThreadedMotoServer\n"
    "s = ThreadedMotoServer('127.0.0.1', 0, verbose=False)\ns.start()\n"
    "print(s.get_host_and_port()[1], flush=True)\nsys.stdin.read()\n"
)


def start_server() -> tuple[subprocess.Popen, str]:
    """moto's S3 on a free port of 127.0.0.1, with the bench bucket; the environment points at it."""
    # niced: a stand-in for a server on another machine, whose CPU the loop would not share
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        preexec_fn=lambda: os.nice(10),
    )
    endpoint = f"http://127.0.0.1:{int(proc.stdout.readline())}"
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
    )
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/{BUCKET}", method="PUT"), timeout=10).read()
    return proc, endpoint


def run_variant(name: str, args: argparse.Namespace, out: Path, round_no: int) -> dict[str, Any]:
    """One loop of ``args.steps`` steps saving every ``args.every``; the timings of one variant."""
    config = load_config(
        {
            "run": {"output_dir": str(out / f"{name}-{round_no}")},
            "checkpoint": {"dir": f"s3://{BUCKET}/{name}-{round_no}" if name == "remote" else None, "keep_last": 2},
        }
    )
    mirror = RemoteMirror.for_run(config, Runtime(env=DistEnv(), device=torch.device("cpu"), backend="gloo"))
    state = {"w": torch.randn(args.mb * (1 << 18))}  # float32: 4 bytes each
    a = torch.randn(384, 384)
    saves, queue, steps, started = [], [], [], time.perf_counter()
    for step in range(1, args.steps + 1):
        t = time.perf_counter()
        for _ in range(8):
            a = torch.tanh(a @ a.T / 384)
        state["w"][:16] += 1.0
        if step > args.warmup:
            steps.append(time.perf_counter() - t)
        if step % args.every == 0:
            t = time.perf_counter()
            info = save_checkpoint(state, config.checkpoint_dir, step=step, keep_last=2)
            queued = time.perf_counter()
            if mirror is not None:
                mirror.saved(info.path)
            if step > args.warmup:
                saves.append(time.perf_counter() - t)
                queue.append(time.perf_counter() - queued)
        if step == args.warmup:
            started = time.perf_counter()
    wall = time.perf_counter() - started
    timed = (("save_ms", saves), ("queue_ms", queue), ("step_ms", steps))
    ms = {name: 1e3 * statistics.median(times) for name, times in timed}
    result = {**ms, "wall_s": wall}
    if mirror is not None:
        lag = mirror.metrics()["remote_lag_steps"]
        mirror.on_exit("finished", deadline_s=300)
        metrics = mirror.metrics()
        result.update(
            lag_steps=lag,
            upload_mb_s=args.mb * (1 << 20) / 1e6 / max(metrics["remote_upload_s"], 1e-9),
            failures=metrics["remote_upload_failures"],
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=16, help="checkpoint size in MiB")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--every", type=int, default=10, help="save every this many steps")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=20, help="steps left out (upload process start)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    server, endpoint = start_server()
    results: dict[str, list[dict[str, Any]]] = {"local": [], "remote": []}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for round_no in range(args.rounds):
                order = ["local", "remote"] if round_no % 2 == 0 else ["remote", "local"]
                for name in order:
                    results[name].append(run_variant(name, args, Path(tmp), round_no))
                    done = results[name][-1]
                    print(f"round {round_no + 1}/{args.rounds} {name}: {done}", file=sys.stderr, flush=True)
    finally:
        server.stdin.close()
        server.wait(timeout=30)
    report(results, args, endpoint)


def report(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace, endpoint: str) -> None:
    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name])

    print(
        f"remote checkpoints against moto's S3 at {endpoint}: {args.mb} MiB state, save every {args.every} of "
        f"{args.steps} steps, {args.rounds} rounds (medians)"
    )
    print(
        f"{'variant':8} {'save ms':>9} {'of which queue ms':>18} {'step ms':>9} {'wall s':>8} {'upload MB/s':>12} "
        f"{'lag steps':>10}"
    )
    for name in ("local", "remote"):
        extra = f"{med(name, 'upload_mb_s'):12.1f} {med(name, 'lag_steps'):10.0f}" if name == "remote" else ""
        print(
            f"{name:8} {med(name, 'save_ms'):9.1f} {med(name, 'queue_ms'):18.3f} {med(name, 'step_ms'):9.2f} "
            f"{med(name, 'wall_s'):8.2f} {extra}"
        )
    ratios = {key: med("remote", key) / med("local", key) for key in ("save_ms", "step_ms", "wall_s")}
    print(
        f"remote/local: save {ratios['save_ms']:.2f}x, step {ratios['step_ms']:.2f}x, wall {ratios['wall_s']:.2f}x; "
        f"failed uploads: {sum(r['failures'] for r in results['remote'])}"
    )


if __name__ == "__main__":
    main()
