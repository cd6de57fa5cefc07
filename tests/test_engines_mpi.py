"""``mpirun -np 3 python train.py`` with Debian's Open MPI: one job of three ranks, bitwise equal to torchrun's.

    apt-get install openmpi-bin      # .ci/run installs it; skipped where mpirun is missing

torch reads no MPI variable, so before ddpkit read Open MPI's (``OMPI_COMM_WORLD_*``,
:mod:`ddpkit.distributed.launcher_env`) this started three unrelated worlds of one. Two nodes are
played on one machine by hiding the ranks' neighbours (local size 1 on every rank): then
``MASTER_ADDR`` is required (mpi4py hidden), and given it, or found by mpi4py, the job trains.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import REPO, assert_bitwise_equal, load_weights, tiny_config

from ddpkit.errors import LaunchError

TRAIN = REPO / "examples" / "train.py"
RECORDING = REPO / "tests" / "scripts" / "recording_trainer.py"
MPIRUN = shutil.which("mpirun")
pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(MPIRUN is None, reason="Open MPI's mpirun is not installed (apt-get install openmpi-bin)"),
]


def _run(argv: list[str], timeout: float = 240, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def _mpirun(
    np: int, *program: str, options: tuple[str, ...] = (), env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return _run([MPIRUN, "--allow-run-as-root", "--oversubscribe", "-np", str(np), *options, *program], env=env)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_mpirun_trains_one_job_bitwise_equal_to_torchrun(tmp_path, tiny_yaml):
    """The ranks are started by mpirun, an engine a pool of ranks cannot stand in for, and torchrun's run of the same
    script is the reference."""
    mpi = _mpirun(3, sys.executable, str(TRAIN), str(tiny_yaml), f"run.output_dir={tmp_path / 'mpi'}")
    assert mpi.returncode == 0, (mpi.stdout + mpi.stderr)[-4000:]
    assert "world_size=3 backend=gloo device=cpu launcher=mpi" in mpi.stderr + mpi.stdout
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3"]
    reference = _run([*torchrun, str(TRAIN), str(tiny_yaml), f"run.output_dir={tmp_path / 'torchrun'}"])
    assert reference.returncode == 0, (reference.stdout + reference.stderr)[-4000:]
    assert_bitwise_equal(load_weights(tmp_path / "mpi" / "model.pt"), load_weights(tmp_path / "torchrun" / "model.pt"))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_rank_killed_under_mpirun_costs_no_step_when_the_command_runs_again(tmp_path):
    """mpirun restarts nothing: the survivors save the last completed step before mpirun ends them, and the
    same command, run again, resumes there and ends bitwise equal to an uninterrupted torchrun."""
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(tiny_config(tmp_path, train={"epochs": 3, "log_every": 4})))
    steps = tmp_path / "steps"
    steps.mkdir()
    program = (sys.executable, str(RECORDING), str(config), f"run.output_dir={tmp_path / 'mpi'}")
    env = {"STEPS_DIR": str(steps), "KILL_STEP": "7"}
    killed = _mpirun(3, *program, options=("-x", "STEPS_DIR", "-x", "KILL_STEP"), env=env)
    assert killed.returncode != 0 and (steps / "killed").exists(), (killed.stdout + killed.stderr)[-4000:]
    assert "rank 0 saved step 7 after" in killed.stderr
    again = _mpirun(3, *program, options=("-x", "STEPS_DIR"), env={"STEPS_DIR": str(steps)})
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    assert "resuming from" in again.stderr and "step-000000007.pt" in again.stderr
    for rank in range(3):
        trained = [int(line.split()[1]) for line in (steps / f"steps-rank{rank}.txt").read_text().splitlines()]
        assert trained == list(range(1, 16)), f"rank {rank} trained {trained}"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3"]
    reference = _run([*torchrun, str(TRAIN), str(config), f"run.output_dir={tmp_path / 'torchrun'}"])
    assert reference.returncode == 0, reference.stderr[-4000:]
    assert_bitwise_equal(load_weights(tmp_path / "mpi" / "model.pt"), load_weights(tmp_path / "torchrun" / "model.pt"))


# Each rank alone on its "node": what mpirun sets on two hosts of one slot each.
AS_IF_TWO_NODES = "OMPI_COMM_WORLD_LOCAL_SIZE=1 OMPI_COMM_WORLD_LOCAL_RANK=0 exec {python} {train} {config} {out}"


def _two_nodes(out: Path, config: Path, *options: str, hide_mpi4py: Path | None = None) -> subprocess.CompletedProcess:
    line = AS_IF_TWO_NODES.format(python=sys.executable, train=TRAIN, config=config, out=f"run.output_dir={out}")
    env = {}
    if hide_mpi4py is not None:
        # a package of that name first on the path that fails to import: as if mpi4py were not installed
        (hide_mpi4py / "mpi4py").mkdir(parents=True)
        (hide_mpi4py / "mpi4py" / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hide_mpi4py), os.environ.get("PYTHONPATH")]))
    return _mpirun(2, "bash", "-c", line, options=options, env=env)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_across_nodes_master_addr_is_required_and_then_enough(tmp_path, tiny_yaml):
    hidden = tmp_path / "hidden"
    refused = _two_nodes(tmp_path / "refused", tiny_yaml, hide_mpi4py=hidden)
    assert refused.returncode == LaunchError.exit_code, (refused.stdout + refused.stderr)[-4000:]
    assert "this MPI job spans several nodes and MASTER_ADDR is not set" in refused.stderr
    assert not (tmp_path / "refused" / "model.pt").exists()
    done = _two_nodes(tmp_path / "given", tiny_yaml, "-x", "MASTER_ADDR=127.0.0.1", hide_mpi4py=tmp_path / "hidden2")
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "world_size=2 backend=gloo device=cpu launcher=mpi" in done.stderr + done.stdout
    assert (tmp_path / "given" / "model.pt").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_across_nodes_mpi4py_finds_rank_0s_host(tmp_path, tiny_yaml):
    pytest.importorskip("mpi4py", reason="mpi4py is not installed (pip install 'ddpkit[mpi]')")
    done = _two_nodes(tmp_path / "run", tiny_yaml)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "world_size=2 backend=gloo device=cpu launcher=mpi" in done.stderr + done.stdout
