"""Multi-node launch on loopback: 2 "nodes" x 1 process equals 1 node x 2 processes, bitwise.

Each "node" is its own ``ddpkit run ... --nnodes 2 --node-rank I --master-addr 127.0.0.1
--master-port P`` launcher process, as on a real cluster; node 0's launcher hosts the rendezvous
store on port P and both join it. Same config, same world size, same seed: same weights.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import REPO, assert_bitwise_equal, load_weights, tiny_config

pytestmark = pytest.mark.multiprocess

TIMEOUT = 120


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
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


def test_two_nodes_of_one_process_match_one_node_of_two(tmp_path):
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
