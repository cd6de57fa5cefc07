"""ddpkit.spark's pieces without a Spark cluster: what each rank's exit code means, the log relay on real
sockets, a rank's environment, the final metrics read back, and what a session's GPU settings allow.

The end-to-end runs on a local Spark cluster are in tests/test_spark.py.
"""

from __future__ import annotations

import io
import socket
import sys
import time

import pytest
import yaml
from helpers import tiny_config

import ddpkit
import ddpkit.spark
from ddpkit.errors import EXIT_CONFIG, EXIT_FAILURE, EXIT_HANG, EXIT_OK, EXIT_PREEMPTED, EXIT_UNHEALTHY, ConfigError
from ddpkit.spark.driver import Attempt, _gpus_per_task, _wait_for_slots, job_exit_code
from ddpkit.spark.logs import TAIL_LINES, LogRelay, LogSender
from ddpkit.spark.task import TaskSpec, final_metrics, rank_environment

pyspark = pytest.importorskip("pyspark", reason="pyspark is not installed (pip install 'ddpkit[spark]')")


@pytest.mark.parametrize(
    ("codes", "job"),
    [
        ({0: 0, 1: 0}, EXIT_OK),
        ({0: 1, 1: -9}, EXIT_FAILURE),  # a rank killed, its peer lost it: retry
        ({0: 2, 1: 2}, EXIT_CONFIG),  # refused everywhere: give up at once
        ({0: 1, 1: 4}, EXIT_UNHEALTHY),  # the unhealthy rank's code, not its peer's
        ({0: 3, 1: 1}, EXIT_HANG),
        ({0: 75, 1: 75}, EXIT_PREEMPTED),  # every rank saved on a signal
        ({0: 75, 1: -15}, EXIT_FAILURE),
    ],
)
def test_the_jobs_code_from_its_ranks(codes, job):
    assert job_exit_code(codes) == job


def test_an_attempt_describes_its_failed_ranks_and_spark_failures():
    assert Attempt(codes={0: 1, 1: -9}).describe() == "rank 0 exited 1, rank 1 exited -9 (SIGKILL)"
    lost = Attempt(spark_error="Stage failed because barrier task ResultTask(0, 1) finished unsuccessfully.")
    assert lost.exit_code == EXIT_FAILURE and lost.describe().startswith("Spark failed the stage: Stage failed")


def test_the_relay_prints_each_ranks_lines_and_keeps_their_tails():
    out = io.StringIO()
    with LogRelay("127.0.0.1", out=out) as relay:
        senders = [LogSender(relay.address, relay.token, rank=rank) for rank in (0, 1)]
        senders[0].send("[rank0] 12:00:00 INFO step 4 loss 2.3")
        for i in range(TAIL_LINES + 5):
            senders[1].send(f"line {i}")
        # a stranger without the token is not heard
        with socket.create_connection(relay.address) as stranger:
            stranger.sendall(b"not-the-token 0\nforged line\n")
        for sender in senders:
            sender.close()
        deadline = time.monotonic() + 10
        while len(relay.tail(1)) < TAIL_LINES or not relay.tail(0):
            assert time.monotonic() < deadline, out.getvalue()
            time.sleep(0.02)
    printed = out.getvalue().splitlines()
    assert "[rank0] 12:00:00 INFO step 4 loss 2.3" in printed  # ddpkit's own prefix kept, not doubled
    assert "[rank 1] line 0" in printed and f"[rank 1] line {TAIL_LINES + 4}" in printed
    assert relay.tail(1)[-1] == f"line {TAIL_LINES + 4}" and len(relay.tail(1)) == TAIL_LINES
    assert not any("forged" in line for line in printed)


def test_a_sender_whose_driver_is_gone_goes_on(capsys):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = sock.getsockname()
    sender = LogSender(address, "token", rank=0, timeout=2)
    sender.send("still training")
    sender.close()
    assert "this rank's lines stay in the executor's log" in capsys.readouterr().out


def _spec(**changes) -> TaskSpec:
    fields = dict(program=("train.py", "c.yaml"), world_size=3, cwd="/", use_gpu=False, relay=("h", 1), token="t")
    return TaskSpec(**{**fields, **changes})


def test_a_ranks_environment_is_torchruns_for_one_process_per_node():
    base = {"PATH": "/bin", "TORCHELASTIC_RESTART_COUNT": "4", "GROUP_WORLD_SIZE": "9", "CUDA_VISIBLE_DEVICES": "0,1"}
    env = rank_environment(
        _spec(extra_env={"NCCL_SOCKET_IFNAME": "eth0"}),
        rank=2,
        master_addr="10.0.0.7",
        master_port=4242,
        gpus=["1"],
        base=base,
    )
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")} == {
        "RANK": "2",
        "WORLD_SIZE": "3",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
    }
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["CUDA_VISIBLE_DEVICES"]) == ("10.0.0.7", "4242", "1")
    assert env["NCCL_SOCKET_IFNAME"] == "eth0" and env["PATH"] == "/bin"
    assert "TORCHELASTIC_RESTART_COUNT" not in env and "GROUP_WORLD_SIZE" not in env
    environ = {k: v for k, v in env.items() if k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    assert ddpkit.read_dist_env({**environ, "LOCAL_WORLD_SIZE": "1"}).launcher == "torchrun"
    cpu = rank_environment(_spec(), rank=0, master_addr="h", master_port=1, gpus=[], base=base)
    assert cpu["CUDA_VISIBLE_DEVICES"] == ""  # no GPU Spark did not give


def test_final_metrics_are_what_fit_returned(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(tiny_config(tmp_path, train={"epochs": 2, "log_every": 5})))
    returned = ddpkit.Trainer(str(config)).fit()
    read = final_metrics(("train.py", "config.yaml"), cwd=str(tmp_path))
    assert read == pytest.approx(returned) and set(read) == set(returned)
    assert final_metrics(("-m", "ddpkit", "train", str(config)), cwd=None) == read
    assert final_metrics(("train.py", str(tmp_path / "missing.yaml")), cwd=None) == {}


class _Session:
    """What the driver's checks read of a session: its SparkContext's conf (a real SparkConf, no JVM) and
    ``defaultParallelism`` (the executors' cores)."""

    def __init__(self, slots: int = 2, **conf: str) -> None:
        self.sparkContext = self
        self.defaultParallelism = slots
        self._conf = pyspark.SparkConf(loadDefaults=False).setAll(list(conf.items()))

    def getConf(self):  # noqa: N802  (pyspark's name)
        return self._conf


def test_gpus_follow_what_the_session_schedules():
    assert _gpus_per_task(_Session(), None) is False
    assert _gpus_per_task(_Session(**{"spark.task.resource.gpu.amount": "1"}), None) is True
    assert _gpus_per_task(_Session(**{"spark.task.resource.gpu.amount": "1"}), False) is False
    with pytest.raises(ConfigError, match="schedules no GPU to its tasks: set spark.task.resource.gpu.amount=1"):
        _gpus_per_task(_Session(), True)
    with pytest.raises(ConfigError, match="spark.task.resource.gpu.amount=2: ddpkit.spark runs one rank per task"):
        _gpus_per_task(_Session(**{"spark.task.resource.gpu.amount": "2"}), None)


def test_a_stage_larger_than_the_task_slots_is_refused_not_waited_on_for_ten_minutes():
    _wait_for_slots(_Session(slots=4), 4, timeout=0)
    with pytest.raises(ConfigError, match="num_processes=3, but this Spark cluster runs 2 task\\(s\\) at once"):
        _wait_for_slots(_Session(slots=4, **{"spark.task.cpus": "2"}), 3, timeout=0.1)
    _wait_for_slots(_Session(slots=1, **{"spark.default.parallelism": "1"}), 8, timeout=0)  # Spark's to judge


def test_run_refuses_bad_counts_before_any_session():
    with pytest.raises(ConfigError, match="use num_processes >= 1 and max_restarts >= 0"):
        ddpkit.spark.run("train.py", num_processes=0)


def test_ddpkit_spark_usage_errors_exit_2(capsys):
    from ddpkit.cli import main

    with pytest.raises(SystemExit) as info:
        main(["spark", "c.yaml"])
    assert info.value.code == 2 and "the following arguments are required: --num-processes" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["spark", str(sys.executable), "--num-processes", "2"])  # not a YAML config: refused before Spark
    assert info.value.code == EXIT_CONFIG
