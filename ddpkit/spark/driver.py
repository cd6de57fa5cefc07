"""The driver's side of ``ddpkit.spark.run``: plan the barrier stage, run it, read every rank's exit code,
start it again after a retryable failure, and say what happened when it gives up.

Spark does not retry a failed barrier result stage ("Could not recover from a failed barrier
ResultStage"): one lost task ends the job. Here every attempt is a new barrier stage of
``num_processes`` tasks; the ranks resume from the run's checkpoints (``run.output_dir`` on storage every
executor sees, or ``checkpoint.dir`` on ``s3://``), so the surviving ranks' crash save of the last
completed step is where the next attempt starts. What an attempt's end means, from the ranks'
codes (:data:`ddpkit.errors.EXIT_CODES`):

* every rank 0: done; the final metrics are returned;
* a rank exited 2 (config, data), 4 (unhealthy) or 130 (Ctrl-C): a retry would not help; give up with it;
* anything else (1: a crash or a lost peer, 3: a hang, 75: stopped by a signal after saving, a rank
  killed by a signal, a task or executor Spark lost): start again, at most ``max_restarts`` times,
  then give up with the code (3 if the watchdog stopped a rank, 75 if every failed rank saved, else 1).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ddpkit.checkpoint.run_lock import STALE_AFTER_S
from ddpkit.errors import (
    EXIT_FAILURE,
    EXIT_HANG,
    EXIT_OK,
    EXIT_PREEMPTED,
    NO_RETRY,
    ConfigError,
    DdpkitError,
    first_line,
)
from ddpkit.spark.logs import LogRelay
from ddpkit.spark.task import TaskSpec, run_rank

__all__ = ["run", "run_program", "session", "SparkJobFailed", "Attempt", "job_exit_code"]

log = logging.getLogger("ddpkit.spark")


class SparkJobFailed(DdpkitError):
    """The Spark job failed and ``ddpkit.spark.run`` gave up; ``exit_code`` is the job's (ddpkit's table),
    ``attempts`` what each attempt ended with."""

    def __init__(self, message: str, *, exit_code: int, attempts: list[Attempt]) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.attempts = attempts


@dataclass
class Attempt:
    """How one barrier stage ended: every rank's exit code, or Spark's error when the stage itself failed."""

    codes: dict[int, int] = dataclasses.field(default_factory=dict)
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    spark_error: str | None = None

    @property
    def exit_code(self) -> int:
        return EXIT_FAILURE if self.spark_error is not None else job_exit_code(self.codes)

    def describe(self) -> str:
        if self.spark_error is not None:
            return f"Spark failed the stage: {self.spark_error}"
        failed = [f"rank {r} exited {_code_text(c)}" for r, c in sorted(self.codes.items()) if c != EXIT_OK]
        return ", ".join(failed) or "every rank exited 0"


def job_exit_code(codes: dict[int, int]) -> int:
    """The job's exit code from its ranks': 0 when all are 0; else the first code a retry will not fix
    (2, 4, 130), else 3 if the watchdog stopped a rank, else 75 if every failed rank saved and stopped, else 1."""
    failed = [code for _, code in sorted(codes.items()) if code != EXIT_OK]
    if not failed:
        return EXIT_OK
    final = [code for code in failed if code in NO_RETRY]
    if final:
        return final[0]
    if EXIT_HANG in failed:
        return EXIT_HANG
    return EXIT_PREEMPTED if all(code == EXIT_PREEMPTED for code in failed) else EXIT_FAILURE


def run(
    script: str,
    *args: str,
    num_processes: int,
    max_restarts: int = 0,
    use_gpu: bool | None = None,
    spark: Any = None,
    env: Mapping[str, str] | None = None,
) -> dict[str, float]:
    """Run ``python script *args`` as ``num_processes`` ranks in one Spark barrier stage; return the final metrics.

    Args:
        script: the training script (a ddpkit ``Trainer.main()`` script), as executors see its path.
        args: its command line: ``"config.yaml"``, ``"key=value"``, ...
        num_processes: the world size: one barrier task, one process, one GPU (with ``use_gpu``) per rank.
        max_restarts: how many times to start the stage again after a retryable failure.
        use_gpu: give each rank the GPU Spark schedules to its task (``spark.task.resource.gpu.amount=1``);
            None (default): when the session schedules GPUs to tasks; False: ``CUDA_VISIBLE_DEVICES`` empty.
        spark: the ``SparkSession``; default the active one (``spark-submit``, ``pyspark``), else a new one.
        env: variables to set for every rank (``NCCL_SOCKET_IFNAME``, your script's own), over the executors'.

    Returns:
        What ``Trainer.fit()`` returned on rank 0 (``train_loss``, the last validation's values, ``step``,
        ``epoch``), read from the run's ``metrics.jsonl``; empty if rank 0 could not find it.

    Raises:
        SparkJobFailed: a rank failed in a way a retry will not fix, or the restarts ran out; its
            ``exit_code`` follows ddpkit's table (``ddpkit spark`` exits with it).
        ConfigError: pyspark is not installed, or the session cannot run ``num_processes`` ranks as asked.
    """
    return run_program(
        [script, *args], num_processes=num_processes, max_restarts=max_restarts, use_gpu=use_gpu, spark=spark, env=env
    )


def run_program(
    program: Sequence[str],
    *,
    num_processes: int,
    max_restarts: int = 0,
    use_gpu: bool | None = None,
    spark: Any = None,
    env: Mapping[str, str] | None = None,
) -> dict[str, float]:
    """:func:`run` for any interpreter arguments (``["-m", "ddpkit", "train", CONFIG]`` for ``ddpkit spark``)."""
    if num_processes < 1 or max_restarts < 0:
        raise ConfigError(
            f"num_processes={num_processes}, max_restarts={max_restarts}: use num_processes >= 1 and max_restarts >= 0"
        )
    spark = spark if spark is not None else session()
    gpus = _gpus_per_task(spark, use_gpu)
    _wait_for_slots(spark, num_processes)
    # A script the driver has is named absolutely: the executors' working directory is not the driver's.
    program = (os.path.abspath(program[0]) if os.path.isfile(program[0]) else program[0], *program[1:])
    host = spark.sparkContext.getConf().get("spark.driver.host", "127.0.0.1")
    attempts: list[Attempt] = []
    with LogRelay(host) as relay:
        spec = TaskSpec(
            program=tuple(program),
            world_size=num_processes,
            cwd=os.getcwd(),
            use_gpu=gpus,
            relay=relay.address,
            token=relay.token,
            extra_env=dict(env or {}),
        )
        for attempt in range(max_restarts + 1):
            ended = _run_stage(spark, dataclasses.replace(spec, attempt=attempt), num_processes)
            attempts.append(ended)
            if ended.exit_code == EXIT_OK:
                return ended.metrics
            if ended.exit_code in NO_RETRY or attempt == max_restarts:
                raise _gave_up(attempts, relay, max_restarts)
            log.warning(
                "ddpkit spark: attempt %d failed (%s); starting the barrier stage again (restart %d of %d): "
                "the ranks resume from the run's checkpoints",
                attempt,
                ended.describe(),
                attempt + 1,
                max_restarts,
            )
            if ended.spark_error is not None:
                # Ranks of the lost stage on other hosts may still hold the run's lock: let it go stale first.
                time.sleep(STALE_AFTER_S)
    raise AssertionError("unreachable")


def _run_stage(session: Any, spec: TaskSpec, num_processes: int) -> Attempt:
    """One barrier stage of ``num_processes`` tasks; every rank's code, or Spark's error."""
    context = session.sparkContext
    group = f"ddpkit-spark-{uuid.uuid4().hex[:12]}"
    context.setJobGroup(group, f"ddpkit spark attempt {spec.attempt}: {' '.join(spec.program)}", interruptOnCancel=True)
    stage = context.parallelize(range(num_processes), num_processes).barrier()
    try:
        results = stage.mapPartitions(functools.partial(run_rank, spec)).collect()
    except KeyboardInterrupt:
        context.cancelJobGroup(group)
        raise
    except Exception as exc:  # py4j's Py4JJavaError, pyspark's own errors: the stage failed, not a rank
        _refuse_unschedulable(exc, num_processes)
        return Attempt(spark_error=_spark_reason(exc))
    ranks = [json.loads(line) for line in results]
    metrics = next((r["metrics"] for r in ranks if r["rank"] == 0), {})
    return Attempt(codes={r["rank"]: r["code"] for r in ranks}, metrics=metrics)


def _gave_up(attempts: list[Attempt], relay: LogRelay, max_restarts: int) -> SparkJobFailed:
    last = attempts[-1]
    tails = [
        f"rank {rank}'s last lines:\n  " + "\n  ".join(relay.tail(rank)[-10:])
        for rank, code in sorted(last.codes.items())
        if code != EXIT_OK and relay.tail(rank)
    ]
    why = "a retry would not fix it" if last.exit_code in NO_RETRY else f"after {max_restarts} restart(s)"
    message = f"the Spark job failed ({why}): {last.describe()}" + ("\n" + "\n".join(tails) if tails else "")
    return SparkJobFailed(message, exit_code=last.exit_code, attempts=attempts)


def session(master: str | None = None) -> Any:
    """The active SparkSession (``spark-submit``'s, ``pyspark``'s), else a new one on ``master``.

    For a local master (``local[N]``, ``local-cluster[...]``) the executors run this interpreter
    unless ``PYSPARK_PYTHON`` names another: Spark's default, ``python3`` on the PATH, is rarely the
    environment that has torch and ddpkit (and pyspark reads only the variable, not ``spark.pyspark.python``).
    """
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        raise ConfigError("ddpkit.spark needs pyspark: pip install 'ddpkit[spark]'") from None
    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    builder = SparkSession.builder.appName("ddpkit")
    if master is not None:
        builder = builder.master(master)
        if master.startswith("local"):
            os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    return builder.getOrCreate()


def _gpus_per_task(session: Any, use_gpu: bool | None) -> bool:
    """Whether each task gets its GPU, checked against what the session schedules."""
    conf = session.sparkContext.getConf()
    amount = float(conf.get("spark.task.resource.gpu.amount", "0"))
    if use_gpu is False:
        return False
    if amount == 0:
        if use_gpu:
            raise ConfigError(
                "use_gpu=True, but this Spark session schedules no GPU to its tasks: set "
                "spark.task.resource.gpu.amount=1 and spark.executor.resource.gpu.amount (with a discovery script), "
                "or use_gpu=False to train on the CPU"
            )
        return False
    if amount != 1:
        raise ConfigError(
            f"spark.task.resource.gpu.amount={conf.get('spark.task.resource.gpu.amount')}: ddpkit.spark runs one "
            "rank per task on one GPU; set it to 1 and num_processes to the number of GPUs"
        )
    return True


#: How long a new session's executors get to register before a stage larger than its task slots is refused.
SLOTS_WAIT_S = 60.0


def _wait_for_slots(spark: Any, num_processes: int, *, timeout: float = SLOTS_WAIT_S) -> None:
    """Refuse a barrier stage the cluster cannot hold, once its executors had ``timeout`` seconds to register.

    Spark itself retries such a stage 40 times, 15 s apart (``spark.scheduler.barrier.maxConcurrentTasksCheck.*``),
    before it fails: ten minutes of nothing. The slots counted are ``defaultParallelism`` (the executors' cores,
    or ``local[N]``'s N) over ``spark.task.cpus``.
    """
    context = spark.sparkContext
    conf = context.getConf()
    if conf.get("spark.default.parallelism") is not None:
        return  # set by hand, it no longer counts the cores: leave the check to Spark
    cpus = max(1, int(conf.get("spark.task.cpus", "1")))
    deadline = time.monotonic() + timeout
    while (slots := context.defaultParallelism // cpus) < num_processes and time.monotonic() < deadline:
        time.sleep(1.0)
    if slots < num_processes:
        raise ConfigError(
            f"num_processes={num_processes}, but this Spark cluster runs {slots} task(s) at once "
            f"(defaultParallelism {context.defaultParallelism} / spark.task.cpus {cpus}) and a barrier stage starts "
            "every rank together: use num_processes <= the task slots, or more executors (or cores)"
        )


def _refuse_unschedulable(exc: Exception, num_processes: int) -> None:
    """A barrier stage larger than the cluster's task slots fails at once, and every retry would too."""
    text = str(exc)
    if "more slots than the total number of slots" in text or "BARRIER_STAGE_WITH_DYNAMIC_ALLOCATION" in text:
        raise ConfigError(
            f"num_processes={num_processes} needs that many Spark task slots at once (one barrier stage), and this "
            f"cluster has fewer, or uses dynamic allocation: {_spark_reason(exc)}"
        ) from None


def _spark_reason(exc: Exception) -> str:
    """The useful line of Spark's error: the failure reason, not the Java stack."""
    text = str(exc)
    for marker in ("Most recent failure reason:", "Job aborted due to stage failure:"):
        if marker in text:
            return first_line(Exception(text.split(marker, 1)[1]))
    return first_line(exc)


def _code_text(code: int) -> str:
    if code < 0:
        import signal

        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            return str(code)
    return str(code)
