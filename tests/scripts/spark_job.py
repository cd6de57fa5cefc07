"""A local Spark cluster running ddpkit scripts three ways; tests/test_spark.py runs it and reads what it prints.

    SPARK_LOCAL_IP=127.0.0.1 python tests/scripts/spark_job.py OUT CONFIG NUM_PROCESSES MASTER

In one session on MASTER (``local-cluster[2,2,1024]``: two executors of two task slots each):

1. Spark's own ``TorchDistributor(..., local_mode=False, use_gpu=False).run("examples/train.py", CONFIG, ...)``
   into OUT/distributor: the script unchanged;
2. ``ddpkit.spark.run("tests/scripts/recording_trainer.py", CONFIG, ..., max_restarts=1)`` into OUT/restarted,
   rank 1 SIGKILLing itself after step 7 the first time (the first attempt fails, the second resumes);
3. ``ddpkit.spark.run("examples/train.py", CONFIG, "optim.lr=-1", max_restarts=2)``: refused on every rank,
   so not retried;
4. as 2. into OUT/lost, but rank 1 SIGKILLs its task's Python worker: Spark loses the task and fails the stage.

Each prints one line ``RESULT <name> <json>`` on stdout; the ranks' lines reach this process's stderr.
"""

import json
import os
import sys
from pathlib import Path

from pyspark.ml.torch.distributor import TorchDistributor
from pyspark.sql import SparkSession

import ddpkit.spark

REPO = Path(__file__).resolve().parents[2]
OUT, CONFIG, WORLD, MASTER = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
TRAIN = str(REPO / "examples" / "train.py")


def result(name: str, value: object) -> None:
    print(f"RESULT {name} {json.dumps(value)}", flush=True)


def killed_mid_run(name: str, steps: Path, *, whom: str) -> dict:
    """ddpkit.spark.run of the recording Trainer into OUT/name, rank 1 killing ``whom`` after step 7 once."""
    steps.mkdir(parents=True, exist_ok=True)
    return ddpkit.spark.run(
        str(REPO / "tests" / "scripts" / "recording_trainer.py"),
        CONFIG,
        f"run.output_dir={OUT / name}",
        num_processes=WORLD,
        max_restarts=1,
        env={"STEPS_DIR": str(steps), "KILL_STEP": "7", "KILL_WHOM": whom},
    )


if __name__ == "__main__":
    os.environ["PYSPARK_PYTHON"] = sys.executable  # the executors' Python: this one, with torch and ddpkit
    spark = (
        SparkSession.builder.master(MASTER)
        .appName("ddpkit-tests")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .getOrCreate()
    )
    distributor = TorchDistributor(num_processes=WORLD, local_mode=False, use_gpu=False)
    result("distributor", distributor.run(TRAIN, CONFIG, f"run.output_dir={OUT / 'distributor'}"))
    result("restarted", killed_mid_run("restarted", OUT / "steps", whom="self"))
    try:
        ddpkit.spark.run(
            TRAIN, CONFIG, "optim.lr=-1", f"run.output_dir={OUT / 'refused'}", num_processes=WORLD, max_restarts=2
        )
    except ddpkit.spark.SparkJobFailed as exc:
        result("refused", {"exit_code": exc.exit_code, "attempts": len(exc.attempts), "message": str(exc)})
    result("lost", killed_mid_run("lost", OUT / "lost-steps", whom="parent"))
    spark.stop()
