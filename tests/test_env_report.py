"""``ddpkit --version`` and ``ddpkit env``: versions, devices, variables and extras for a bug report.

.venv/bin/pytest -q tests/test_env_report.py
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import run_cli

from ddpkit import __version__
from ddpkit.tools.env_report import EXTRAS, environment, format_environment, variables

pytestmark = pytest.mark.timeout(120)


def test_the_report_names_versions_devices_and_extras():
    env = environment()
    assert env["ddpkit"] == __version__ and env["torch"] == torch.__version__
    assert env["distributed"]["gloo"] is True and env["cuda"]["available"] == torch.cuda.is_available()
    assert set(env["extras"]) == set(EXTRAS) and env["cpus"]["usable"] >= 1
    text = format_environment(env)
    for label in (
        "ddpkit",
        "torch",
        "python",
        "platform",
        "CPUs",
        "CUDA",
        "GPUs",
        "NCCL",
        "Gloo",
        "extras",
        "variables",
    ):
        assert f"\n{label} " in f"\n{text}" or f"\n{label}\n" in f"\n{text}\n", label


def test_variables_are_the_launchers_and_the_libraries_and_never_a_credential():
    environ = {
        "RANK": "1",
        "SLURM_JOB_ID": "7",
        "NCCL_DEBUG": "INFO",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "HOME": "/root",
        "NCCL_SECRET_THING": "x",
        "WANDB_API_KEY": "k",
        "TORCHELASTIC_RESTART_COUNT": "0",
    }
    assert variables(environ) == {
        "NCCL_DEBUG": "INFO",
        "RANK": "1",
        "SLURM_JOB_ID": "7",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }


@pytest.mark.multiprocess
def test_the_commands():
    done = run_cli("--version")
    assert (done.returncode, done.stdout.strip()) == (0, f"ddpkit {__version__}")
    done = run_cli("env", "--json", env={"NCCL_DEBUG": "WARN"})
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["ddpkit"] == __version__ and report["variables"]["NCCL_DEBUG"] == "WARN"
    done = run_cli("env")
    assert done.returncode == 0 and done.stdout.startswith(f"ddpkit     {__version__}\n")
