"""Launch problems: one clear message each (what is wrong and what to do), no traceback from torch.

Most run the command line in this process (``ddpkit.cli.main``, the code behind ``ddpkit`` and
``python -m ddpkit``) with a world of one, so no worker is started; the cases whose environment
describes several ranks run ``python -m ddpkit`` in a subprocess, because a failed rank of several
exits its process at once.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import torch
from helpers import run_cli

from ddpkit import LaunchError
from ddpkit.cli import main as cli_main
from ddpkit.distributed.env import DistEnv
from ddpkit.distributed.process_group import resolve_device

# torch's @record tries to enable faulthandler on stderr, which pytest's capture cannot provide.
pytestmark = pytest.mark.filterwarnings("ignore:Unable to enable fault handler:UserWarning")


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port another program is listening on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def run_main(capsys, *argv: str) -> tuple[int, str]:
    """``ddpkit ARGV`` in this process: (exit code, everything printed)."""
    with pytest.raises(SystemExit) as exited:
        cli_main(list(argv))
    out = capsys.readouterr()
    return exited.value.code, out.out + out.err


def assert_one_clear_message(output: str, message: str) -> None:
    assert message in output, output
    assert "Traceback" not in output, output


def set_launcher_env(monkeypatch, **values: object) -> None:
    for name, value in values.items():
        monkeypatch.setenv(name, str(value))


def test_ddpkit_run_with_a_master_port_in_use(capsys, tiny_yaml, busy_port):
    code, output = run_main(capsys, "run", str(tiny_yaml), "--nproc-per-node", "2", "--master-port", str(busy_port))
    assert code == 1
    assert_one_clear_message(
        output,
        f"ddpkit run: error: --master-port {busy_port} is already in use on this machine (another job?). "
        "Pick another with --master-port=PORT, or leave --master-port out to get a free one.",
    )


def test_a_process_whose_master_port_is_in_use(capsys, monkeypatch, tiny_yaml, busy_port):
    set_launcher_env(
        monkeypatch,
        RANK=0,
        WORLD_SIZE=1,
        LOCAL_RANK=0,
        LOCAL_WORLD_SIZE=1,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=busy_port,
    )
    code, output = run_main(capsys, "train", str(tiny_yaml))
    assert code == 1
    assert_one_clear_message(
        output,
        f"ddpkit: error: port {busy_port} is already in use (MASTER_ADDR=127.0.0.1 MASTER_PORT={busy_port}), "
        "probably by another job. Pick a free one with --master-port=PORT, or use `ddpkit run`, which picks "
        "a free port by default.",
    )


NCCL_ON_CPU = (
    "dist.backend=nccl needs CUDA GPUs, but this run is on the CPU (torch.cuda.is_available() is False); "
    "use dist.backend=gloo or auto"
)


def test_nccl_without_cuda_is_refused_before_any_worker_starts(tiny_yaml):
    """The refusal must come from the real command before torchrun or any worker starts: exit code 2 and one message."""
    done = run_cli("run", str(tiny_yaml), "--nproc-per-node", "2", "dist.backend=nccl", timeout=120)
    assert done.returncode == 2
    assert_one_clear_message(done.stdout + done.stderr, f"ddpkit run: error: {NCCL_ON_CPU}")
    assert "torchelastic" not in done.stderr and "[rank" not in done.stderr  # no launcher, no worker


def test_nccl_without_cuda_in_a_worker(capsys, tiny_yaml):
    code, output = run_main(capsys, "train", str(tiny_yaml), "dist.backend=nccl")
    assert code == 2
    assert_one_clear_message(output, f"ddpkit: error: {NCCL_ON_CPU}")


@pytest.mark.parametrize(
    ("present", "missing"),
    [
        ({"RANK": 0}, "WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT"),
        ({"RANK": 0, "WORLD_SIZE": 1, "LOCAL_RANK": 0}, "MASTER_ADDR, MASTER_PORT"),
        ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 29500}, "RANK, WORLD_SIZE, LOCAL_RANK"),
    ],
)
def test_a_partial_torchrun_environment(capsys, monkeypatch, tiny_yaml, present, missing):
    set_launcher_env(monkeypatch, **present)
    code, output = run_main(capsys, "train", str(tiny_yaml))
    assert code == 1
    assert_one_clear_message(
        output,
        f"ddpkit: error: partial torchrun environment: {', '.join(present)} set but {missing} missing. "
        "Launch with `torchrun --nproc-per-node=N script.py` or `ddpkit run CONFIG`, "
        "or unset these variables to run a single process.",
    )


@pytest.mark.multiprocess
def test_a_world_size_that_is_not_nodes_times_processes_per_node(tiny_yaml):
    # torchrun sets GROUP_WORLD_SIZE to the number of nodes; 1 node x 2 processes is not a world of 4.
    env = {
        "RANK": "0",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }
    done = run_cli("train", str(tiny_yaml), env=env, timeout=120)
    assert done.returncode == 1
    assert_one_clear_message(
        done.stdout + done.stderr,
        "ddpkit: error: WORLD_SIZE=4 does not match 1 node(s) (GROUP_WORLD_SIZE) x 2 process(es) per node "
        "(LOCAL_WORLD_SIZE) = 2: start every node with the same --nnodes and --nproc-per-node, and set WORLD_SIZE "
        "(if you set it by hand) to --nnodes x --nproc-per-node",
    )


@pytest.fixture
def one_visible_gpu(monkeypatch) -> None:
    """Pretend this machine has one CUDA GPU (there is none: nothing may actually use it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


GPU_SHORTAGE = (
    "LOCAL_RANK=1 has no GPU: only 1 visible on this node "
    "(CUDA_VISIBLE_DEVICES=<unset>). Use --nproc-per-node=1 or fewer."
)


def test_more_local_processes_than_gpus_is_refused_by_ddpkit_run(capsys, tiny_yaml, one_visible_gpu):
    code, output = run_main(capsys, "run", str(tiny_yaml), "--nproc-per-node", "2")
    assert code == 2  # a refused launch: a retry will not fix it (ddpkit.errors.EXIT_CODES)
    assert_one_clear_message(output, f"ddpkit run: error: {GPU_SHORTAGE}")


def test_more_local_processes_than_gpus_in_a_worker(one_visible_gpu):
    assert resolve_device(DistEnv(rank=0, local_rank=0, world_size=2, local_world_size=2)) == torch.device("cuda", 0)
    with pytest.raises(LaunchError) as caught:
        resolve_device(DistEnv(rank=1, local_rank=1, world_size=2, local_world_size=2))
    assert str(caught.value) == GPU_SHORTAGE


def test_a_scripts_defaults_give_way_to_the_keys_the_command_line_sets():
    from ddpkit.launch.entrypoint import parse_worker_argv

    defaults = ["run.name=demo", "train.epochs=10", "model.kwargs.hidden=[64]", "optim.lr=0.1"]
    path, overrides = parse_worker_argv(["exp.yaml", "train.epochs=2", "model.kwargs={hidden: [8]}"], defaults=defaults)
    assert path == "exp.yaml"
    assert overrides == ["run.name=demo", "optim.lr=0.1", "train.epochs=2", "model.kwargs={hidden: [8]}"]
    assert parse_worker_argv([], defaults=defaults) == (None, defaults)
