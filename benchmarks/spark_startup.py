"""What a Spark launch costs against torchrun: the same ddpkit script, side by side, over alternated rounds.

    SPARK_LOCAL_IP=127.0.0.1 python -m benchmarks.spark_startup            # 5 rounds, 2 ranks (~6 min on 2 cores)
    SPARK_LOCAL_IP=127.0.0.1 python -m benchmarks.spark_startup --rounds 3 --nproc 2

The job is examples/train.py on the tests' tiny config (an MLP on 256 generated digits, one epoch: well
under a second of training), so each wall time is almost all start-up. Per round, in rotated order:

* ``torchrun``: ``python -m torch.distributed.run --standalone --nproc-per-node N examples/train.py ...``;
* ``ddpkit.spark.run``: the same script as N barrier tasks on a warm ``local-cluster[N,1,1024]`` session;
* ``TorchDistributor``: ``TorchDistributor(N, local_mode=False, use_gpu=False).run(...)`` on that session.

Printed: each launch's wall seconds (median, range) and its ratio to torchrun's in the same round,
then the session's own start (JVMs: driver, master, workers, executors; once, before the rounds),
which a ``spark-submit`` job pays once and a notebook has already paid; the load average before and after.
Needs pyspark and Java (``pip install "ddpkit[spark]"``, ``apt-get install openjdk-17-jre-headless``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.workloads import REPO, load_printed, paired, rotated, summary, table

TRAIN = REPO / "examples" / "train.py"


def tiny_config(directory: Path) -> Path:
    """The tests' tiny config (tests/helpers.py's ``tiny_config``), one epoch."""
    cfg = {
        "run": {"name": "bench", "output_dir": str(directory / "run"), "seed": 0},
        "data": {"name": "digits", "batch_size": 16, "kwargs": {"num_train": 256, "num_val": 101, "image_size": 12}},
        "model": {"name": "mlp", "kwargs": {"in_features": 144, "hidden": [32]}},
        "optim": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
        "train": {"epochs": 1, "log_every": 4},
        "checkpoint": {"every_epochs": None},
        "log": {"progress_bar": False},
    }
    path = directory / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def timed(launch) -> float:
    start = time.perf_counter()
    launch()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.spark_startup")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args(argv)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.ml.torch.distributor import TorchDistributor
    from pyspark.sql import SparkSession

    import ddpkit.spark

    work = Path(tempfile.mkdtemp(prefix="spark-startup-"))
    config = tiny_config(work)
    n = args.nproc
    with load_printed():
        session_s = timed(
            lambda: (
                SparkSession.builder.master(f"local-cluster[{n},1,1024]")
                .config("spark.driver.host", "127.0.0.1")
                .config("spark.ui.showConsoleProgress", "false")
                .getOrCreate()
                .range(n, numPartitions=n)
                .collect()
            )  # the executors are up only once a first job ran
        )
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"]
        launches = {
            "torchrun": lambda out: subprocess.run(
                [*torchrun, str(TRAIN), str(config), f"run.output_dir={out}"], check=True, capture_output=True
            ),
            "ddpkit.spark.run": lambda out: ddpkit.spark.run(
                str(TRAIN), str(config), f"run.output_dir={out}", num_processes=n
            ),
            "TorchDistributor": lambda out: TorchDistributor(n, local_mode=False, use_gpu=False).run(
                str(TRAIN), str(config), f"run.output_dir={out}"
            ),
        }
        times: dict[str, list[float]] = {name: [] for name in launches}
        for round_ in range(args.rounds):
            for name in rotated(list(launches), round_):
                times[name].append(timed(lambda: launches[name](work / f"{name}-{round_}")))
            print(f"round {round_ + 1}: " + ", ".join(f"{k} {v[-1]:.1f} s" for k, v in times.items()), flush=True)
        rows = []
        for name, values in times.items():
            wall, ratio = summary(values), paired(values, times["torchrun"])
            rows.append([name, f"{wall.median:.2f}", wall.spread(2), f"{ratio.median:.2f}", ratio.spread(2)])
        title = f"{n} ranks, {args.rounds} rounds: launch to exit of the same script (one epoch of the tiny MLP)"
        print(table(title, ["launch", "wall s", "range", "/ torchrun", "range"], rows))
        print(f"the session's own start (local-cluster[{n},1,1024], once): {session_s:.1f} s")
        SparkSession.getActiveSession().stop()


if __name__ == "__main__":
    main()
