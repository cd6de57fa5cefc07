"""ddpkit scripts on a real local Spark cluster (``local-cluster``: a master, workers and executor JVMs on 127.0.0.1).

    apt-get install openjdk-17-jre-headless; pip install "ddpkit[spark]"      # .ci/run does both

Spark's own TorchDistributor runs examples/train.py unchanged; ``ddpkit.spark.run`` survives a rank
SIGKILLed mid-run by starting the barrier stage again, loses no completed step, and ends bitwise
equal to torchrun with the same world size (3 ranks: on 2, a + b == b + a would hide a reordered
reduction); a task Spark loses (its Python worker killed) is a failed stage, started again too; a
refused config is not retried and gives the job exit code 2; ``ddpkit spark`` does the same from the
command line. Each Spark session takes 20 to 40 s to start here, so one job script
(tests/scripts/spark_job.py) runs the three cases in one session.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import REPO, assert_bitwise_equal, load_weights, tiny_config

JOB = REPO / "tests" / "scripts" / "spark_job.py"
TRAIN = REPO / "examples" / "train.py"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.multiprocess,
    pytest.mark.skipif(
        shutil.which("java") is None, reason="Spark needs Java (apt-get install openjdk-17-jre-headless)"
    ),
]


def _env() -> dict[str, str]:
    pytest.importorskip("pyspark", reason="pyspark is not installed (pip install 'ddpkit[spark]')")
    return {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _torchrun(tmp_path: Path, config: Path, nproc: int) -> dict:
    out = tmp_path / f"torchrun{nproc}"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    done = subprocess.run(
        [*argv, str(TRAIN), str(config), f"run.output_dir={out}"],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return load_weights(out / "model.pt")


def _results(stdout: str) -> dict[str, object]:
    lines = [line.split(" ", 2) for line in stdout.splitlines() if line.startswith("RESULT ")]
    return {name: json.loads(value) for _, name, value in lines}


@pytest.mark.timeout(1200)
def test_distributor_and_ddpkit_spark_with_a_killed_rank_end_bitwise_equal_to_torchrun(tmp_path):
    """An engine: the ranks run as tasks of a local Spark cluster, which a pool of ranks cannot stand in for."""
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(tiny_config(tmp_path, train={"epochs": 3, "log_every": 4})))
    out = tmp_path / "out"
    argv = [sys.executable, str(JOB), str(out), str(config), "3", "local-cluster[2,2,1024]"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=_env(), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-6000:]
    results = _results(done.stdout)
    reference = _torchrun(tmp_path, config, 3)

    # 1. TorchDistributor(local_mode=False, use_gpu=False).run("train.py", CONFIG, ...): the script as it is
    assert results["distributor"] is None  # a file's run returns nothing
    assert_bitwise_equal(load_weights(out / "distributor" / "model.pt"), reference)

    # 2. ddpkit.spark.run, rank 1 SIGKILLed after step 7: a second barrier stage resumed from step 7
    assert (out / "steps" / "killed").exists(), "rank 1 was never killed"
    log = done.stderr
    assert "attempt 0 failed (rank 0 exited 1, rank 1 exited -9 (SIGKILL), rank 2 exited 1)" in log
    assert "saved step 7 after" in log and "resuming from" in log and "step-000000007.pt" in log
    for rank in (0, 1, 2):
        records = [line.split() for line in (out / "steps" / f"steps-rank{rank}.txt").read_text().splitlines()]
        assert [int(step) for _, step in records] == list(range(1, 16)), f"rank {rank}: no step twice, none skipped"
        assert len({pid for pid, _ in records}) == 2  # two attempts
    assert_bitwise_equal(load_weights(out / "restarted" / "model.pt"), reference)
    metrics = results["restarted"]
    assert (metrics["step"], metrics["epoch"]) == (15, 3) and {"train_loss", "val_accuracy", "val_loss"} <= set(metrics)
    # every rank's lines reached the driver, each attempt's
    for rank in (0, 1, 2):
        for attempt in (0, 1):
            assert f"[rank {rank}] ddpkit spark: attempt {attempt}: rank {rank} of 3" in log

    # 3. a config every rank refuses: exit code 2 at once, though two restarts were allowed
    refused = results["refused"]
    assert (refused["exit_code"], refused["attempts"]) == (2, 1)
    assert "a retry would not fix it" in refused["message"] and "optim.lr: expected a value > 0" in refused["message"]

    # 4. rank 1's task lost (its Python worker SIGKILLed): Spark fails the stage, the driver starts another
    assert "attempt 0 failed (Spark failed the stage: Stage failed because barrier task" in log
    assert (out / "lost-steps" / "killed").exists() and results["lost"]["step"] == 15
    assert_bitwise_equal(load_weights(out / "lost" / "model.pt"), reference)


@pytest.mark.timeout(900)
def test_the_ddpkit_spark_command_trains_on_local_cluster_and_prints_the_final_metrics(tmp_path):
    """An engine and its command: `ddpkit spark` as a user types it, on a local Spark cluster."""
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(tiny_config(tmp_path)))
    command = [sys.executable, "-m", "ddpkit", "spark", str(config), "--num-processes", "2", "--json"]
    done = subprocess.run(
        [*command, "--master", "local-cluster[2,1,1024]", "--max-restarts", "1", f"run.output_dir={tmp_path / 'run'}"],
        capture_output=True,
        text=True,
        timeout=600,
        env=_env(),
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-6000:]
    metrics = json.loads(done.stdout.strip().splitlines()[-1])
    assert metrics["step"] == 16 and "val_loss" in metrics
    assert "launcher=torchrun" in done.stderr and "[rank 1] ddpkit spark: attempt 0: rank 1 of 2" in done.stderr
    assert_bitwise_equal(load_weights(tmp_path / "run" / "model.pt"), _torchrun(tmp_path, config, 2))
