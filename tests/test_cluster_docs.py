"""The cluster launch examples of docs/multinode.md hold up: a Kubeflow PyTorchJob and a TorchX component.

No cluster is reachable here, so each is checked at schema level (fields, env, command) and then
its rendered command is run for real on this machine: the PyTorchJob's two pods as two
`ddpkit run` processes with the variables the Training Operator sets, the TorchX component with
TorchX's own local_cwd scheduler.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import REPO

from ddpkit.cli import _parser
from ddpkit.config.loader import load_config

CLUSTER = REPO / "examples" / "cluster"
MANIFEST = CLUSTER / "pytorchjob.yaml"
COMPONENT = CLUSTER / "torchx_ddpkit.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def operator_env(job: dict, replica_type: str, index: int) -> dict[str, str]:
    """The variables the Kubeflow Training Operator (v1.7+) puts in a PyTorchJob pod's container."""
    specs = job["spec"]["pytorchReplicaSpecs"]
    pods = sum(spec["replicas"] for spec in specs.values())
    nproc = job["spec"].get("nprocPerNode", "1")
    rank = index + (1 if replica_type == "Worker" else 0)  # the master is node 0
    container = specs["Master"]["template"]["spec"]["containers"][0]
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == "pytorchjob-port")
    return {
        "MASTER_ADDR": f"{job['metadata']['name']}-master-0",
        "MASTER_PORT": str(port),
        "PYTHONUNBUFFERED": "0",
        "WORLD_SIZE": str(pods * int(nproc)),
        "RANK": str(rank),
        "PET_NPROC_PER_NODE": nproc,
        "PET_NODE_RANK": str(rank),
        "PET_NNODES": str(pods),
    }


def render_pod(job: dict, replica_type: str, index: int, **env_changes: str) -> tuple[list[str], dict[str, str]]:
    """A pod's argv after Kubernetes' $(VAR) expansion, and its environment."""
    container = job["spec"]["pytorchReplicaSpecs"][replica_type]["template"]["spec"]["containers"][0]
    env = {
        **{e["name"]: e["value"] for e in container.get("env", [])},
        **operator_env(job, replica_type, index),
        **env_changes,
    }
    argv = []
    for arg in [*container["command"], *container.get("args", [])]:
        unknown = [name for name in re.findall(r"\$\((\w+)\)", arg) if name not in env]
        assert not unknown, f"{arg!r} refers to variables nobody sets: {unknown}"
        argv.append(re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg))
    return argv, env


def test_pytorchjob_manifest_has_the_fields_the_operator_needs():
    job = yaml.safe_load(MANIFEST.read_text())
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"} and specs["Master"]["replicas"] == 1
    assert isinstance(job["spec"]["nprocPerNode"], str)  # a string in the CRD ("4", "auto")
    for spec in specs.values():
        assert spec["restartPolicy"] in ("OnFailure", "ExitCode")  # a failed pod restarts and resumes
        pod = spec["template"]["spec"]
        (container,) = pod["containers"]
        assert container["name"] == "pytorch" and container["image"]
        assert any(p["name"] == "pytorchjob-port" and isinstance(p["containerPort"], int) for p in container["ports"])
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert "persistentVolumeClaim" in volumes[mounts["/runs"]]  # shared storage for checkpoints
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
        assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == int(job["spec"]["nprocPerNode"])


@pytest.mark.parametrize("replica_type", ["Master", "Worker"])
def test_each_pods_command_is_a_valid_ddpkit_run(replica_type):
    """Parses each pod's command with `ddpkit run`'s own parser and loads its config; it starts no process
    (test_the_two_pods_train_together runs the commands)."""
    job = yaml.safe_load(MANIFEST.read_text())
    argv, env = render_pod(job, replica_type, 0)
    assert argv[:2] == ["ddpkit", "run"]
    _, commands = _parser()
    args = commands["run"].parse_intermixed_args(argv[2:])
    node_rank = 0 if replica_type == "Master" else 1
    assert (args.nnodes, args.node_rank, args.nproc_per_node) == ("2", node_rank, "4")
    assert (args.master_addr, args.master_port) == ("ddpkit-quickstart-master-0", 23456)
    cfg = load_config(REPO / args.config, args.overrides)  # the config and every override are valid
    assert cfg.output_dir.startswith("/runs/")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_two_pods_train_together(tmp_path, tiny_yaml):
    """Both pods' commands, on loopback, with the operator's variables (RANK and WORLD_SIZE included)."""
    job = yaml.safe_load(MANIFEST.read_text())
    job["spec"]["nprocPerNode"] = "1"  # one CPU worker per "pod" here
    config, out = tiny_yaml, tmp_path / "out"
    port = str(_free_port())
    procs = []
    for replica_type in ("Master", "Worker"):
        argv, env = render_pod(job, replica_type, 0, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NCCL_SOCKET_IFNAME="lo")
        # the example's own directory, replaced (a key twice is refused)
        rest = [a for a in argv[3:] if not a.startswith("run.output_dir=")]
        argv = [sys.executable, "-m", "ddpkit", "run", str(config), *rest, f"run.output_dir={out}"]
        full_env = {**os.environ, **env, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
        procs.append(
            subprocess.Popen(
                argv, env=full_env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    try:
        outputs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    assert "world_size=2" in outputs[0] and (out / "model.pt").exists()


def _component():
    pytest.importorskip("torchx")
    spec = importlib.util.spec_from_file_location("torchx_ddpkit", COMPONENT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_torchx_component_renders_a_ddpkit_run_per_node():
    module = _component()
    from torchx.specs import macros
    from torchx.specs.file_linter import validate

    assert validate(str(COMPONENT), "train") == []  # what `torchx run` checks before it runs a component
    app = module.train(
        "optim.lr=0.1",
        "run.name=it's",
        config="configs/quickstart.yaml",
        nnodes=3,
        nproc_per_node=4,
        gpu=4,
        rdzv_port=29411,
        env={"NCCL_SOCKET_IFNAME": "eth0"},
    )
    (role,) = app.roles
    assert role.num_replicas == 3 and role.resource.gpu == 4 and role.port_map == {"c10d": 29411}
    assert role.env["NCCL_SOCKET_IFNAME"] == "eth0" and role.entrypoint == "bash"
    values = macros.Values(img_root="", app_id="ddpkit-abc", replica_id="2", rank0_env="TORCHX_RANK0_HOST")
    flag, script = values.apply(role).args
    assert flag == "-c"
    assert script.endswith('--rdzv-endpoint "${TORCHX_RANK0_HOST:=localhost}:29411" --rdzv-id ddpkit-abc')
    shell = subprocess.run(
        ["bash", "-c", f'printf "%s\\n" {script.removeprefix("ddpkit run ")}'],
        capture_output=True,
        text=True,
        env={"TORCHX_RANK0_HOST": "node0", "PATH": os.environ["PATH"]},
    )
    argv = shell.stdout.splitlines()  # what the shell on a node hands to `ddpkit run`
    _, commands = _parser()
    args = commands["run"].parse_intermixed_args(argv)
    assert (args.nnodes, args.nproc_per_node, args.rdzv_endpoint, args.rdzv_id) == (
        "3",
        "4",
        "node0:29411",
        "ddpkit-abc",
    )
    assert args.overrides == ["optim.lr=0.1", "run.name=it's"]  # quoting survives the shell
    load_config(REPO / args.config, args.overrides)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bash") is None, reason="TorchX's component runs through bash")
def test_torchx_local_scheduler_runs_two_nodes(tmp_path, tiny_yaml):
    _component()
    config, out = tiny_yaml, tmp_path / "out"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    torchx = [sys.executable, "-m", "torchx.cli.main"] if importlib.util.find_spec("torchx.cli.main") else ["torchx"]
    done = subprocess.run(
        [
            *torchx,
            "run",
            "-s",
            "local_cwd",
            "--wait",
            f"{COMPONENT}:train",
            "--config",
            str(config),
            "--nnodes",
            "2",
            "--rdzv_port",
            str(_free_port()),
            f"run.output_dir={out}",
            "log.progress_bar=false",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "SUCCEEDED" in done.stdout + done.stderr
    assert (out / "model.pt").exists() and "world_size=2" in done.stdout + done.stderr
