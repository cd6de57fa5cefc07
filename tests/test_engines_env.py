"""The launchers Horovod users bring, read from their variables: MPI, LSF's jsrun, Kubeflow, dask-pytorch-ddp.

No process group: each launcher's variables are given as a mapping, as the launcher sets them
(tests/test_engines_mpi.py runs Debian's real ``mpirun``).
"""

from __future__ import annotations

import pytest
from helpers import REPO

from ddpkit import LaunchError
from ddpkit.distributed.env import DistEnv, read_dist_env
from ddpkit.distributed.launcher_env import agreed_port

# What Open MPI 4.1's mpirun sets for rank 1 of 3 on one node (checked with `mpirun ... env`).
OPEN_MPI = {
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_SIZE": "3",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "3",
    "OMPI_COMM_WORLD_NODE_RANK": "1",
    "OMPI_MCA_ess_base_jobid": "1900675073",
    "PMIX_NAMESPACE": "1900675073",
    "PMIX_RANK": "1",
}
# MPICH's and Intel MPI's Hydra: rank 5 of 8, two nodes of 4.
HYDRA = {"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4", "PMI_FD": "7"}
# LSF's jsrun: rank 2 of 4 on one node.
JSRUN = {
    "JSM_NAMESPACE_RANK": "2",
    "JSM_NAMESPACE_SIZE": "4",
    "JSM_NAMESPACE_LOCAL_RANK": "2",
    "JSM_NAMESPACE_LOCAL_SIZE": "4",
    "LSB_JOBID": "4242",
}


def test_open_mpi_on_one_node_meets_on_loopback_at_the_jobs_port():
    env = read_dist_env(OPEN_MPI)
    assert env == DistEnv(
        rank=1,
        local_rank=1,
        world_size=3,
        local_world_size=3,
        master_addr="127.0.0.1",
        master_port=agreed_port("1900675073"),
        launcher="mpi",
    )
    assert 15000 <= env.master_port < 35000
    # every rank computes the same port from the job's id, and another job gets another one
    assert read_dist_env({**OPEN_MPI, "OMPI_COMM_WORLD_RANK": "0"}).master_port == env.master_port
    assert read_dist_env({**OPEN_MPI, "PMIX_NAMESPACE": "77"}).master_port != env.master_port


def test_master_addr_and_port_win_and_are_not_half_a_torchrun_environment():
    env = read_dist_env({**OPEN_MPI, "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29511"})
    assert (env.master_addr, env.master_port, env.launcher) == ("10.1.2.3", 29511, "mpi")


def test_without_a_job_id_one_node_agrees_on_the_parents_pid(monkeypatch):
    monkeypatch.setattr("os.getppid", lambda: 4321)
    environ = {k: v for k, v in OPEN_MPI.items() if k not in ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid")}
    assert read_dist_env(environ).master_port == agreed_port("ppid-4321")


def test_hydra_across_nodes_needs_master_addr():
    with pytest.raises(LaunchError) as caught:
        read_dist_env(HYDRA)
    message = str(caught.value)
    assert "spans several nodes and MASTER_ADDR is not set" in message
    assert "mpirun -x MASTER_ADDR" in message and "-genv MASTER_ADDR" in message and "mpi4py" in message
    # the address given, but no job id to agree a port on: the port too, with how
    with pytest.raises(LaunchError, match="export MASTER_PORT=<a free port on rank 0's host>"):
        read_dist_env({**HYDRA, "MASTER_ADDR": "node1"})
    env = read_dist_env({**HYDRA, "MASTER_ADDR": "node1", "MASTER_PORT": "29400"})
    assert env == DistEnv(
        rank=5, local_rank=1, world_size=8, local_world_size=4, master_addr="node1", master_port=29400, launcher="mpi"
    )
    assert read_dist_env({**HYDRA, "MASTER_ADDR": "node1", "PMI_JOBID": "j7"}).master_port == agreed_port("j7")


def test_pmi_local_rank_variables_and_mvapich():
    cray = {"PMI_RANK": "3", "PMI_SIZE": "4", "PMI_LOCAL_RANK": "3", "PMI_LOCAL_SIZE": "4"}
    assert (read_dist_env(cray).local_rank, read_dist_env(cray).master_addr) == (3, "127.0.0.1")
    mvapich = {
        "MV2_COMM_WORLD_RANK": "0",
        "MV2_COMM_WORLD_SIZE": "2",
        "MV2_COMM_WORLD_LOCAL_RANK": "0",
        "MV2_COMM_WORLD_LOCAL_SIZE": "2",
    }
    assert read_dist_env(mvapich).world_size == 2


def test_jsrun_reads_as_lsf():
    env = read_dist_env(JSRUN)
    assert (env.rank, env.world_size, env.local_rank, env.launcher) == (2, 4, 2, "lsf")
    assert env.master_port == agreed_port("4242")


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        (
            {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"},
            "partial Open MPI environment: OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE set but "
            "OMPI_COMM_WORLD_LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_SIZE missing",
        ),
        ({"PMI_RANK": "0"}, "partial MPICH / Intel MPI environment: PMI_RANK set but PMI_SIZE, MPI_LOCALRANKID"),
        (
            {"PMI_RANK": "1", "PMI_SIZE": "2", "PMI_LOCAL_RANK": "1"},
            "PMI_RANK, PMI_SIZE, PMI_LOCAL_RANK set but PMI_LOCAL_SIZE missing",
        ),
        ({k: v for k, v in JSRUN.items() if k != "JSM_NAMESPACE_SIZE"}, "partial LSF jsrun environment"),
        ({**OPEN_MPI, "OMPI_COMM_WORLD_RANK": "3"}, "OMPI_COMM_WORLD_RANK=3 of OMPI_COMM_WORLD_SIZE=3"),
        ({**OPEN_MPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, "do not fit together"),
        ({**OPEN_MPI, "OMPI_COMM_WORLD_SIZE": "two"}, "OMPI_COMM_WORLD_SIZE='two' is not an integer"),
        ({**OPEN_MPI, "MASTER_PORT": "x"}, "MASTER_PORT='x' is not an integer"),
    ],
)
def test_a_half_set_or_inconsistent_mpi_environment_is_refused(environ, message):
    with pytest.raises(LaunchError) as caught:
        read_dist_env(environ)
    assert message in str(caught.value)
    if "partial" in message:
        assert "mpirun -np N python train.py" in str(caught.value)


def test_torchrun_wins_over_mpi_and_mpi_over_slurm():
    torchrun = {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1234",
    }
    # `mpirun torchrun ...`: the workers' variables are torchrun's
    assert read_dist_env({**OPEN_MPI, **torchrun}).launcher == "torchrun"
    # mpirun inside an sbatch allocation: SLURM_PROCID is the node's task, OMPI_COMM_WORLD_RANK the rank
    srun = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "n[1-2]"}
    assert read_dist_env({**srun, **OPEN_MPI}).rank == 1


# --- Kubernetes and the launchers that set torchrun's global variables only ------------------------------------

TRAINJOB = {
    "PET_NNODES": "2",
    "PET_NPROC_PER_NODE": "4",
    "PET_NODE_RANK": "1",
    "PET_MASTER_ADDR": "job-node-0-0.job",
    "PET_MASTER_PORT": "29400",
}


def test_a_trainjob_pod_running_plain_python_is_refused_with_the_fix():
    with pytest.raises(LaunchError) as caught:
        read_dist_env(TRAINJOB)
    message = str(caught.value)
    assert "Kubeflow job (PET_NNODES=2, PET_NPROC_PER_NODE=4) but torchrun was not started" in message
    assert "command: [torchrun, train.py, CONFIG]" in message and "--nnodes=$(PET_NNODES)" in message


def test_kubeflow_variables_under_torchrun_or_for_one_process_are_fine():
    torchrun = {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "job-node-0-0.job",
        "MASTER_PORT": "29400",
    }
    assert read_dist_env({**TRAINJOB, **torchrun}).rank == 5
    assert read_dist_env({"PET_NNODES": "1", "PET_NPROC_PER_NODE": "1"}) == DistEnv()


def test_a_pytorchjob_of_one_plain_process_per_pod_trains_and_of_several_is_refused():
    pod = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"}
    env = read_dist_env({**pod, "PET_NNODES": "2", "PET_NPROC_PER_NODE": "1"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.launcher) == (1, 2, 0, 1, "env")
    with pytest.raises(LaunchError, match="PET_NPROC_PER_NODE=4\\) but RANK=1 is the pod's index"):
        read_dist_env({**pod, "WORLD_SIZE": "8", "PET_NNODES": "2", "PET_NPROC_PER_NODE": "4"})


def test_dask_pytorch_ddp_sets_global_variables_only_one_process_per_host():
    # dask-pytorch-ddp's dispatch sets these four (and creates the group) in each dask worker
    env = read_dist_env({"RANK": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "10.0.0.4", "MASTER_PORT": "23456"})
    assert env == DistEnv(
        rank=2,
        local_rank=0,
        world_size=3,
        local_world_size=1,
        master_addr="10.0.0.4",
        master_port=23456,
        launcher="env",
    )
    # one of the four missing is still half a torchrun environment
    with pytest.raises(LaunchError, match="RANK, WORLD_SIZE, MASTER_ADDR set but LOCAL_RANK, MASTER_PORT missing"):
        read_dist_env({"RANK": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "10.0.0.4"})


def test_the_trainjob_example_says_the_port_its_command_uses():
    text = (REPO / "examples" / "cluster" / "trainjob.yaml").read_text()
    assert "--master-port=$(PET_MASTER_PORT)" in text
    assert "The port the code uses: PET_MASTER_PORT (29400) on node 0" in text
    assert "every TCP port" in text  # Gloo's and NCCL's own connections
