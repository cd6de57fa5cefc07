"""Multi-node launch on loopback: 2 "nodes" x 1 process equals 1 node x 2 processes, bitwise.

Each "node" is its own ``ddpkit run ... --nnodes 2 --node-rank I --master-addr 127.0.0.1
--master-port P`` launcher process, as on a real cluster; node 0's launcher hosts the rendezvous
store on port P and both join it. Same config, same world size, same seed: same weights.

scripts/slurm.sbatch is checked with stand-ins for ``srun``, ``scontrol`` and ``ddpkit``: each
node's task must run ``ddpkit run`` with its own ``--node-rank`` and the shared master address.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import REPO, assert_bitwise_equal, free_port, load_weights, tiny_config

TIMEOUT = 120


def write_config(tmp_path: Path, name: str) -> Path:
    cfg = tiny_config(tmp_path / name, train={"epochs": 1, "log_every": 4})
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def launch(config: Path, *args: str) -> subprocess.Popen:
    """Start ``ddpkit run CONFIG ARGS`` (one launcher: one "node") with its output in a pipe."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "ddpkit", "run", str(config), *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(launchers: list[subprocess.Popen]) -> list[str]:
    """Wait for every launcher (killing all on a timeout); return their outputs."""
    try:
        return [proc.communicate(timeout=TIMEOUT)[0] for proc in launchers]
    finally:
        for proc in launchers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.multiprocess
def test_two_nodes_of_one_process_match_one_node_of_two(tmp_path):
    """A second node: two `ddpkit run` launchers on loopback, node 0's hosting the rendezvous store that both join."""
    port = free_port()
    multi = write_config(tmp_path, "multi")
    node_args = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port), "--nproc-per-node", "1"]
    # All three launchers at once: most of their time is spent importing torch.
    launchers = [
        launch(multi, *node_args, "--node-rank", "0"),
        launch(multi, *node_args, "--node-rank", "1"),
        launch(write_config(tmp_path, "single"), "--nproc-per-node", "2"),
    ]
    outputs = finish(launchers)
    for name, proc, output in zip(["node 0", "node 1", "single node"], launchers, outputs):
        assert proc.returncode == 0, f"{name} failed:\n{output}"
    assert "world_size=2" in outputs[0] and "[rank0]" in outputs[0]  # global rank 0 runs on node 0
    assert "world_size=2" in outputs[2]

    multi_weights = load_weights(tmp_path / "multi" / "run" / "model.pt")
    assert_bitwise_equal(multi_weights, load_weights(tmp_path / "single" / "run" / "model.pt"))


def fake_slurm_bin(tmp_path: Path) -> Path:
    """`scontrol`, `srun` and `ddpkit` stand-ins: srun runs its command once per node, ddpkit records its argv."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        # `scontrol requeue JOB` is recorded; `scontrol show hostnames` lists two nodes.
        "scontrol": 'if [ "$1" = requeue ]; then echo "$@" > "$FAKE_OUT/requeue"; '
        "else echo node001; echo node002; fi\n",
        # Drop srun's own options, then run the command as each node's task would.
        "srun": 'while [ "${1#--}" != "$1" ]; do shift; done\n'
        'for node in $(seq 0 $((SLURM_NNODES - 1))); do SLURM_NODEID=$node "$@" || exit $?; done\n',
        "ddpkit": 'printf "%s\\n" "$@" > "$FAKE_OUT/node$SLURM_NODEID"\nexit "${FAKE_EXIT:-0}"\n',
    }
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text("#!/bin/bash\n" + body)
        path.chmod(0o755)
    return bin_dir


def test_slurm_script_runs_ddpkit_run_once_per_node_with_its_node_rank(tmp_path):
    from ddpkit.cli import _parser, torchrun_args

    bin_dir = fake_slurm_bin(tmp_path)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FAKE_OUT": str(tmp_path),
        "SLURM_JOB_NODELIST": "node[001-002]",
        "SLURM_JOB_ID": "1234",
        "SLURM_NNODES": "2",
        "NPROC_PER_NODE": "4",
    }
    script = REPO / "scripts" / "slurm.sbatch"
    done = subprocess.run(
        ["bash", str(script), "configs/my run.yaml", "optim.lr=0.1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    assert "rendezvous on node001:16234" in done.stdout

    for node in (0, 1):
        argv = (tmp_path / f"node{node}").read_text().splitlines()
        assert argv == [
            "run",
            "configs/my run.yaml",
            "optim.lr=0.1",
            "--nnodes",
            "2",
            "--node-rank",
            str(node),
            "--master-addr",
            "node001",
            "--master-port",
            "16234",
            "--nproc-per-node",
            "4",
        ]
    # ... and ddpkit's CLI turns node 1's arguments into the matching torchrun arguments.
    args = _parser()[1]["run"].parse_intermixed_args(argv[1:])
    assert {"--nnodes=2", "--node-rank=1", "--master-addr=node001", "--master-port=16234", "--nproc-per-node=4"} <= set(
        torchrun_args(args)
    )

    usage = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert usage.returncode == 2 and "usage: sbatch scripts/slurm.sbatch CONFIG" in usage.stderr


def test_slurm_script_requeues_a_preempted_job_and_passes_other_failures_on(tmp_path):
    bin_dir = fake_slurm_bin(tmp_path)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FAKE_OUT": str(tmp_path),
        "SLURM_JOB_NODELIST": "node[001-002]",
        "SLURM_JOB_ID": "1234",
        "SLURM_NNODES": "2",
    }
    script = REPO / "scripts" / "slurm.sbatch"
    assert "#SBATCH --signal=USR1@120" in script.read_text() and "#SBATCH --requeue" in script.read_text()
    preempted = subprocess.run(
        ["bash", str(script), "c.yaml"], env={**env, "FAKE_EXIT": "75"}, capture_output=True, text=True, timeout=30
    )
    assert preempted.returncode == 0, preempted.stderr
    assert (tmp_path / "requeue").read_text().split() == ["requeue", "1234"]
    (tmp_path / "requeue").unlink()
    failed = subprocess.run(
        ["bash", str(script), "c.yaml"], env={**env, "FAKE_EXIT": "1"}, capture_output=True, text=True, timeout=30
    )
    assert failed.returncode == 1 and not (tmp_path / "requeue").exists()
