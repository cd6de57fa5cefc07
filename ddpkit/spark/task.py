"""What each Spark barrier task runs: one rank of the job, as a child process with torchrun's variables.

    rdd.barrier().mapPartitions(functools.partial(run_rank, spec)).collect()   # ddpkit.spark.driver does this

A task is one rank: partition ``r`` is ``RANK=r``. Task 0 picks a free port on its host and every
task learns it (``BarrierTaskContext.allGather``), with task 0's host as ``MASTER_ADDR``. Then the task
starts the program (``python train.py CONFIG key=value ...``) with ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK=0``, ``LOCAL_WORLD_SIZE=1``, ``MASTER_ADDR``, ``MASTER_PORT`` set, as torchrun would for
one process per node: the Trainer reads them as torchrun's (:func:`ddpkit.distributed.read_dist_env`).
With GPUs, the task's own (``BarrierTaskContext.resources()["gpu"]``) are its ``CUDA_VISIBLE_DEVICES``,
so local rank 0 is the GPU Spark gave it; without, ``CUDA_VISIBLE_DEVICES`` is empty.

The program's output goes line by line to the executor's stdout and to the driver (:mod:`ddpkit.spark.logs`).
The task never fails on the program's exit code: it returns it, so that when one rank dies the
others end on their own (their next collective fails, they save the last completed step, the crash
save, and exit 1) and the driver sees every rank's code. The child dies with the task's Python
worker (``PR_SET_PDEATHSIG``): when Spark kills a task, nothing of the old attempt trains on.
"""

from __future__ import annotations

import collections
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpkit.spark.logs import TAIL_LINES, LogSender

__all__ = ["TaskSpec", "run_rank", "rank_environment", "final_metrics"]

# prctl(2): the signal this process gets when the thread that started it ends.
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class TaskSpec:
    """Everything a task needs, pickled by Spark from the driver to every executor."""

    #: What follows the interpreter: ``["train.py", "config.yaml", "key=value", ...]`` or ``["-m", "ddpkit", ...]``.
    program: tuple[str, ...]
    world_size: int
    #: The driver's working directory: the program runs there when the executor has it (one machine, a
    #: shared filesystem), so relative paths mean what they meant on the driver.
    cwd: str
    use_gpu: bool
    relay: tuple[str, int]
    token: str
    #: Which attempt of the run this is (0 first), for the program's lines and the report.
    attempt: int = 0
    extra_env: dict[str, str] = field(default_factory=dict)


def run_rank(spec: TaskSpec, _partition: Iterator[Any]) -> Iterator[str]:
    """The barrier task: agree where rank 0 listens, run the program as this rank, yield one JSON result line."""
    from pyspark import BarrierTaskContext

    context = BarrierTaskContext.get()
    rank = context.partitionId()
    hosts = [info.address.rsplit(":", 1)[0] for info in context.getTaskInfos()]
    port = context.allGather(str(_free_port(hosts[0])) if rank == 0 else "")[0]
    gpus = _task_gpus(context) if spec.use_gpu else []
    env = rank_environment(spec, rank=rank, master_addr=hosts[0], master_port=int(port), gpus=gpus)
    code, tail = _run_child(spec, env, rank=rank)
    metrics = final_metrics(spec.program, cwd=_workdir(spec)) if rank == 0 and code == 0 else {}
    yield json.dumps({"rank": rank, "host": socket.gethostname(), "code": code, "tail": tail, "metrics": metrics})


def rank_environment(
    spec: TaskSpec, *, rank: int, master_addr: str, master_port: int, gpus: list[str], base: dict | None = None
) -> dict[str, str]:
    """The child's environment: the executor's, plus torchrun's variables for one process per node."""
    env = dict(os.environ if base is None else base)
    env.update(spec.extra_env)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(spec.world_size),
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
        PYTHONUNBUFFERED="1",
        CUDA_VISIBLE_DEVICES=",".join(gpus),
    )
    # A launcher of another kind above this one (torchrun's restart count, a group's node count) is not this job's.
    for name in ("GROUP_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE"):
        env.pop(name, None)
    return env


def _task_gpus(context: Any) -> list[str]:
    """The GPUs Spark gave this task, as ``CUDA_VISIBLE_DEVICES`` entries.

    Spark's addresses index the devices the executor sees: when the executor itself was started with
    ``CUDA_VISIBLE_DEVICES`` (YARN, Kubernetes), address ``i`` is that list's ``i``-th entry.
    """
    resource = context.resources().get("gpu")
    addresses = list(resource.addresses) if resource is not None else []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        entries = visible.split(",")
        return [entries[int(a)] if a.isdigit() and int(a) < len(entries) else a for a in addresses]
    return addresses


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _workdir(spec: TaskSpec) -> str | None:
    return spec.cwd if os.path.isdir(spec.cwd) else None


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the task's worker (this process's parent) is gone."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _run_child(spec: TaskSpec, env: dict[str, str], *, rank: int) -> tuple[int, list[str]]:
    """Run the program; copy its lines to stdout and the driver; return (exit code, last lines)."""
    sender = LogSender(spec.relay, spec.token, rank=rank)
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    sender.send(f"ddpkit spark: attempt {spec.attempt}: rank {rank} of {spec.world_size} on {socket.gethostname()}")
    child = subprocess.Popen(
        [sys.executable, *spec.program],
        cwd=_workdir(spec),
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        preexec_fn=_die_with_parent if sys.platform == "linux" else None,
    )
    try:
        assert child.stdout is not None
        for raw in child.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            tail.append(line)
            print(line, flush=True)
            sender.send(line)
        code = child.wait()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        sender.close()
    return code, list(tail)


def final_metrics(program: tuple[str, ...], *, cwd: str | None) -> dict[str, float]:
    """What ``Trainer.fit()`` returned, read back from the run's ``metrics.jsonl``: the last ``train_loss``,
    the last validation's values, the final step and epoch. Empty when the run's directory cannot be found
    from the program's ``CONFIG key=value ...`` (a script that sets its own ``defaults``, say)."""
    from ddpkit.config.loader import load_config
    from ddpkit.errors import DdpkitError
    from ddpkit.launch.entrypoint import parse_worker_argv

    args = list(program[3:] if program[:1] == ("-m",) else program[1:])
    try:
        config, overrides = parse_worker_argv(args)
        # Relative paths meant the child's working directory, not this worker's.
        config = os.path.join(cwd, config) if cwd and config else config
        output_dir = Path(cwd or ".", load_config(config, overrides).output_dir)
        lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    except (DdpkitError, OSError, SystemExit):
        return {}
    metrics: dict[str, float] = {}
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut by a crash
        metrics.update(_fit_fields(record))
        metrics["step"] = max(int(record.get("step", 0)), int(metrics.get("step", 0)))
        metrics["epoch"] = max(int(record.get("epoch", 0)), int(metrics.get("epoch", 0)))
    return metrics


def _fit_fields(record: dict[str, Any]) -> dict[str, float]:
    """The fields of one ``metrics.jsonl`` record that ``fit()`` returns: ``train_loss`` and validation values."""
    if "train_loss" in record:
        return {"train_loss": record["train_loss"]}
    return {k: v for k, v in record.items() if k not in ("step", "epoch", "time") and isinstance(v, (int, float))}
