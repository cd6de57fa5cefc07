"""A TorchX component that runs ``ddpkit run`` on N nodes: one role, one replica per node.

    torchx run -s kubernetes examples/cluster/torchx_ddpkit.py:train \
        --image registry.example.com/ml/ddpkit:latest --nnodes 2 --nproc_per_node 4 --gpu 4 \
        --config configs/quickstart.yaml run.output_dir=/runs/quickstart
    torchx run -s local_cwd examples/cluster/torchx_ddpkit.py:train --nnodes 2 --config configs/quickstart.yaml

Each replica runs ``ddpkit run CONFIG [key=value ...] --nnodes N --nproc-per-node P
--rdzv-endpoint RANK0_HOST:PORT --rdzv-id APP_ID``: torch's c10d rendezvous, hosted by the
first replica, whose address the scheduler passes in an environment variable (TorchX's
``rank0_env`` macro). Node ranks are handed out as replicas join. ``run.output_dir`` must be on
storage every replica shares (``--mounts``) for checkpoints and resume.
tests/test_cluster_docs.py renders this component and runs it with the local_cwd scheduler.
"""

import shlex
from typing import Dict, List, Optional  # noqa: UP035 - TorchX's component linter reads these spellings

import torchx.specs as specs


def train(
    *overrides: str,
    config: str,
    image: str = "registry.example.com/ml/ddpkit:latest",
    nnodes: int = 2,
    nproc_per_node: int = 1,
    cpu: int = 4,
    gpu: int = 0,
    memMB: int = 16384,
    rdzv_port: int = 29500,
    max_retries: int = 0,
    env: Optional[Dict[str, str]] = None,  # noqa: UP006, UP045 - see the import
    mounts: Optional[List[str]] = None,  # noqa: UP006, UP045
) -> specs.AppDef:
    """ddpkit training on ``nnodes`` x ``nproc_per_node`` processes.

    Args:
        overrides: config overrides, e.g. optim.lr=0.1 train.epochs=8
        config: the YAML config, a path inside the image (or the working directory for local_cwd)
        image: container image with ddpkit installed
        nnodes: number of nodes (replicas)
        nproc_per_node: training processes per node, e.g. one per GPU
        cpu: CPUs per node
        gpu: GPUs per node
        memMB: memory per node in MB
        rdzv_port: port of the rendezvous store on the first node
        max_retries: times the scheduler may restart the job (ddpkit resumes from the newest checkpoint)
        env: extra environment variables, e.g. NCCL_SOCKET_IFNAME=eth0
        mounts: shared storage for run.output_dir, e.g. type=volume,src=runs,dst=/runs
    """
    # "$$" is a literal "$" for TorchX's macro substitution; the shell then expands the variable
    # that holds the first node's address (unset on that node itself with some schedulers).
    endpoint = f'"$${{{specs.macros.rank0_env}:=localhost}}:{rdzv_port}"'
    command = ["ddpkit", "run", config, *overrides, "--nnodes", str(nnodes), "--nproc-per-node", str(nproc_per_node)]
    script = " ".join(shlex.quote(arg).replace("$", "$$") for arg in command)
    script += f" --rdzv-endpoint {endpoint} --rdzv-id {specs.macros.app_id}"
    return specs.AppDef(
        name="ddpkit",
        roles=[
            specs.Role(
                name="trainer",
                image=image,
                entrypoint="bash",
                args=["-c", script],
                num_replicas=nnodes,
                resource=specs.resource(cpu=cpu, gpu=gpu, memMB=memMB),
                env={"PYTHONUNBUFFERED": "1", **(env or {})},
                port_map={"c10d": rdzv_port},
                max_retries=max_retries,
                mounts=specs.parse_mounts(mounts) if mounts else [],
            )
        ],
    )
