"""Small builders shared by tests: tiny configs, subprocess runners, weight comparisons."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]


def tiny_config(tmp_path: Path | str, **sections: Any) -> dict[str, Any]:
    """A fast config (MLP on a few hundred generated digits), with per-section overrides merged in."""
    cfg: dict[str, Any] = {
        "run": {"name": "test", "output_dir": str(Path(tmp_path) / "run"), "seed": 0},
        "data": {"name": "digits", "batch_size": 16, "kwargs": {"num_train": 256, "num_val": 101, "image_size": 12}},
        "model": {"name": "mlp", "kwargs": {"in_features": 144, "hidden": [32]}},
        "optim": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
        "train": {"epochs": 2, "log_every": 4},
        "checkpoint": {"every_epochs": None},
        "log": {"progress_bar": False},
        "dist": {"timeout": 60},
    }
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def run_cli(*args: str, timeout: float = 180, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m ddpkit ARGS`` in a subprocess; return the completed process (text output)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    try:
        return subprocess.run(
            [sys.executable, "-m", "ddpkit", *args], capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd or REPO
        )
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-4000:]
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        raise AssertionError(f"`ddpkit {' '.join(args)}` still running after {timeout}s; its stderr ended with:\n{tail}") from None


def load_weights(path: Path | str) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs (max abs diff {(a[key] - b[key]).abs().max().item():.3g})"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for a launcher's --master-port or rendezvous endpoint)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def processes_mentioning(marker: str) -> dict[int, str]:
    """pid -> command line of every process (but this one) whose command line contains ``marker``.

    Exited processes not yet reaped (zombies) have an empty command line and do not count.
    """
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # exited meanwhile
        if marker in cmdline:
            found[int(entry.name)] = cmdline
    return found


def samples_by_step(directory: Path) -> dict[int, set[int]]:
    """Step -> the samples all ranks trained on in that step, from the ``rank*.jsonl`` records the test
    trainers write (the last record of a step wins: a restarted attempt replays the steps after its checkpoint)."""
    per_rank: dict[Path, dict[int, list[int]]] = {}
    for file in sorted(Path(directory).glob("rank*.jsonl")):
        for line in file.read_text().splitlines():
            record = json.loads(line)
            per_rank.setdefault(file, {})[record["step"]] = record["indices"]
    steps = set().union(*(records.keys() for records in per_rank.values()))
    return {step: set().union(*(set(records.get(step, [])) for records in per_rank.values())) for step in steps}
