"""Reading the launcher's variables (torchrun, SLURM, none) into a DistEnv: no process group needed."""

from __future__ import annotations

import pytest

from ddpkit import LaunchError
from ddpkit.distributed.env import DistEnv, first_slurm_host, read_dist_env

TORCHRUN = {
    "RANK": "3",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_WORLD_SIZE": "2",
    "MASTER_ADDR": "node7",
    "MASTER_PORT": "29400",
}
SRUN = {
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_STEP_ID": "0",
    "SLURM_JOB_ID": "123456",
    "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
}


def test_nothing_set_is_a_world_of_one():
    assert read_dist_env({}) == DistEnv()
    env = read_dist_env({})
    assert (env.rank, env.world_size, env.launcher, env.is_main) == (0, 1, "none", True)


def test_reads_os_environ_by_default(monkeypatch):
    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)
    assert read_dist_env() == read_dist_env(TORCHRUN)


def test_torchrun_variables():
    env = read_dist_env({**TORCHRUN, "TORCHELASTIC_RESTART_COUNT": "2"})
    assert env == DistEnv(
        rank=3,
        local_rank=1,
        world_size=4,
        local_world_size=2,
        master_addr="node7",
        master_port=29400,
        launcher="torchrun",
        restart_count=2,
    )
    assert not env.is_main and env.world_size > 1


def test_local_world_size_and_group_world_size_are_optional():
    env = read_dist_env({k: v for k, v in TORCHRUN.items() if k not in ("LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE")})
    assert (env.local_world_size, env.world_size) == (4, 4)


@pytest.mark.parametrize(
    ("drop", "message"),
    [
        (
            ["WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"],
            "RANK, LOCAL_WORLD_SIZE set but WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT missing",
        ),
        (["MASTER_PORT"], "set but MASTER_PORT missing"),
        (["RANK"], "set but RANK missing"),
    ],
)
def test_a_partial_torchrun_environment_is_refused(drop, message):
    environ = {k: v for k, v in TORCHRUN.items() if k not in drop and k != "GROUP_WORLD_SIZE"}
    with pytest.raises(LaunchError) as caught:
        read_dist_env(environ)
    assert message in str(caught.value)
    assert "Launch with `torchrun --nproc-per-node=N script.py` or `ddpkit run CONFIG`" in str(caught.value)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"RANK": "three"}, "environment variable RANK='three' is not an integer; check how the job was launched"),
        ({"MASTER_PORT": ""}, "environment variable MASTER_PORT='' is not an integer"),
        ({"WORLD_SIZE": "0"}, "environment variable WORLD_SIZE=0 must be >= 1; check how the job was launched"),
        ({"LOCAL_RANK": "-1"}, "environment variable LOCAL_RANK=-1 must be >= 0"),
        ({"TORCHELASTIC_RESTART_COUNT": "x"}, "TORCHELASTIC_RESTART_COUNT='x' is not an integer"),
        ({"RANK": "4"}, "RANK=4 is not below WORLD_SIZE=4; check the launcher's --nnodes and --nproc-per-node"),
        ({"LOCAL_RANK": "2"}, "LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2; check the launcher's --nproc-per-node"),
        (
            {"LOCAL_WORLD_SIZE": "3", "LOCAL_RANK": "0", "GROUP_WORLD_SIZE": "1"},
            "WORLD_SIZE=4 is not a multiple of LOCAL_WORLD_SIZE=3",
        ),
        (
            {"GROUP_WORLD_SIZE": "1"},
            "WORLD_SIZE=4 does not match 1 node(s) (GROUP_WORLD_SIZE) x 2 process(es) per node (LOCAL_WORLD_SIZE) = 2: "
            "start every node with the same --nnodes and --nproc-per-node",
        ),
        (
            {"GROUP_WORLD_SIZE": "3"},
            "WORLD_SIZE=4 does not match 3 node(s) (GROUP_WORLD_SIZE) x 2 process(es) per node",
        ),
    ],
)
def test_invalid_torchrun_values_are_refused_with_the_variable_and_value(changes, message):
    with pytest.raises(LaunchError) as caught:
        read_dist_env({**TORCHRUN, **changes})
    assert message in str(caught.value)


def test_srun_variables():
    env = read_dist_env(SRUN)
    assert env == DistEnv(
        rank=5,
        local_rank=1,
        world_size=8,
        local_world_size=4,
        master_addr="gpu07",
        master_port=15000 + 123456 % 20000,
        launcher="slurm",
        restart_count=0,
    )


def test_srun_master_address_and_port_can_be_set_explicitly():
    # Job scripts often export these two; under srun they are not a partial torchrun environment.
    env = read_dist_env({**SRUN, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29555", "SLURM_RESTART_COUNT": "1"})
    assert (env.master_addr, env.master_port, env.restart_count) == ("10.0.0.1", 29555, 1)


def test_srun_defaults_when_optional_variables_are_missing():
    minimal = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "cpu[1-2]"}
    env = read_dist_env(minimal)
    assert (env.local_rank, env.local_world_size, env.master_addr, env.master_port) == (0, 2, "cpu1", 15000)
    assert read_dist_env({**minimal, "SLURM_JOB_ID": "interactive"}).master_port == 29500


@pytest.mark.parametrize(
    "environ",
    [
        {**SRUN, "SLURM_NTASKS": "1"},  # a single task: nothing to coordinate
        {k: v for k, v in SRUN.items() if k != "SLURM_STEP_ID"},  # a bare salloc shell, not inside srun
    ],
)
def test_slurm_outside_a_multi_task_step_is_a_world_of_one(environ):
    assert read_dist_env(environ) == DistEnv()


def test_torchrun_variables_win_over_slurm():
    # torchrun started inside an allocation: its variables describe the workers.
    assert read_dist_env({**SRUN, **TORCHRUN}).launcher == "torchrun"
    with pytest.raises(LaunchError, match="partial torchrun environment: RANK set but"):
        read_dist_env({**SRUN, "RANK": "0"})


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"SLURM_PROCID": "x"}, "SLURM_PROCID='x' is not an integer"),
        ({"SLURM_NTASKS": "0"}, "SLURM_NTASKS=0 must be >= 1"),
    ],
)
def test_invalid_slurm_values_are_refused(changes, message):
    with pytest.raises(LaunchError, match=message):
        read_dist_env({**SRUN, **changes})


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("gpu[07-09,12],cpu1", "gpu07"),
        ("gpu[12,07-09]", "gpu12"),
        ("node1,node2", "node1"),
        ("n[1-3]", "n1"),
        ("single-host", "single-host"),
        ("  host.example.org  ", "host.example.org"),
        ("a1-[001-004]", "a1-001"),
    ],
)
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first
