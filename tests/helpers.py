"""Builders shared by the test modules: tiny configs, a CPU runtime, subprocess runners, weight comparisons.

One module on pytest's ``pythonpath`` (pyproject.toml), so tests import it as ``helpers`` and so
do the ranks that :func:`run_in_pool` runs them on (they inherit the path). conftest.py binds
the most used ones to a test as fixtures (``tiny_cfg``, ``tiny_yaml``, ``world_of_one``). Whatever
a second test module needs from a first one belongs here, never imported from the other test.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import yaml

from ddpkit.distributed import DistEnv, Runtime, read_dist_env
from ddpkit.testing import shared_pools

REPO = Path(__file__).resolve().parents[1]


def run_in_pool(
    fn: Any, world_size: int = 2, *, args: tuple = (), timeout: float = 120.0, env: dict[str, str] | None = None
) -> list[Any]:
    """``ddpkit.testing.run_on_ranks``'s call on the session's live ranks (``shared_pools()``, the ``rank_pool``
    fixture's pools): each call a fresh Gloo group on a reset rank, without starting processes and imports again."""
    return shared_pools().run(fn, world_size, args=args, timeout=timeout, env=env)


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
    return merge_sections(cfg, sections)


def tiny_cnn_config(tmp_path: Path | str, **sections: Any) -> dict[str, Any]:
    """:func:`tiny_config` with the MNIST CNN (it has dropout, so a resume must restore every RNG) on
    16x16 digits, 40 of them held out; per-section overrides merged in."""
    cfg = tiny_config(
        tmp_path,
        model={"name": "mnist_cnn", "kwargs": {"image_size": 16}},
        data={"kwargs": {"num_train": 256, "num_val": 40, "image_size": 16}},
    )
    return merge_sections(cfg, sections)


def merge_sections(cfg: dict[str, Any], sections: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``cfg`` with each section's keys updated from ``sections`` (a key's value is replaced whole)."""
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def cpu_runtime(*, world_size: int | None = None, store: Any = None) -> Runtime:
    """A Gloo :class:`Runtime` on the CPU, as the Trainer's process group would resolve it.

    By default this process's place from its launcher variables: rank r of a spawned world, or a
    world of one. With ``world_size``: rank 0 of that many ranks with no process group behind it,
    for code that only reads the runtime (the watchdog's on/off rule, say).
    """
    env = read_dist_env() if world_size is None else DistEnv(world_size=world_size, local_world_size=world_size)
    return Runtime(env=env, device=torch.device("cpu"), backend="gloo", store=store)


def load_script(path: Path | str) -> ModuleType:
    """Import the Python file ``path`` as a module named after it, without putting its folder on ``sys.path``.

    For the scripts the tests also run as programs (``tests/scripts/*.py``, ``scripts/*.py``); the module
    is registered in ``sys.modules`` under its file's stem, so what it defines pickles by name.
    """
    path = Path(path).resolve()
    loaded = sys.modules.get(path.stem)
    if loaded is not None and Path(getattr(loaded, "__file__", "")) == path:
        return loaded
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def run_cli(
    *args: str, timeout: float = 180, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """Run ``python -m ddpkit ARGS`` in a subprocess; return the completed process (text output)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    try:
        return subprocess.run(
            [sys.executable, "-m", "ddpkit", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=full_env,
            cwd=cwd or REPO,
        )
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-4000:]
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        command = f"ddpkit {' '.join(args)}"
        raise AssertionError(f"`{command}` still running after {timeout}s; its stderr ended with:\n{tail}") from None


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


def parse_table(text: str) -> list[dict[str, str]]:
    """The rows of the first table in ``text``, keyed by header; columns are found from the dashed rule.

    The table ends at the first line that is blank or has text where two columns are separated.
    """
    lines = text.splitlines()
    rule = next(i for i, line in enumerate(lines) if re.fullmatch(r"-+(  -+)*", line))
    ends = [m.end() for m in re.finditer(r"-+", lines[rule])]
    starts = [0, *ends[:-1]]

    def cells(line: str) -> list[str]:
        return [line[a : b if i < len(ends) - 1 else None].strip() for i, (a, b) in enumerate(zip(starts, ends))]

    header, rows = cells(lines[rule - 1]), []
    for line in lines[rule + 1 :]:
        if not line.strip() or any(line[end : end + 2].strip() for end in ends[:-1]):
            break
        rows.append(dict(zip(header, cells(line))))
    return rows


class Exploit:
    """A pickled payload that runs ``touch MARKER`` when unpickled: what a checkpoint loader must refuse."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def start_gated_run(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, dict]:
    """``ddpkit run`` of tests/scripts/gated_trainer.py on 2 ranks, paused by rank 0 after step 3 until
    :func:`finish`; returns the launcher and rank 0's ``{"port": its store's port, "pid": ...}``."""
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(tiny_config(tmp_path, train={"epochs": 2, "log_every": 4})))
    script = REPO / "tests" / "scripts" / "gated_trainer.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "GATE_DIR": str(tmp_path)}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "ddpkit", "run", str(config), "--nproc-per-node", "2", "--script", str(script), *extra],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not (tmp_path / "ready.json").exists():
        if launcher.poll() is not None or time.monotonic() > deadline:
            launcher.kill()
            raise AssertionError(f"the run never reached step 3:\n{launcher.communicate()[0][-4000:]}")
        time.sleep(0.1)
    return launcher, json.loads((tmp_path / "ready.json").read_text())


def finish(launcher: subprocess.Popen, tmp_path: Path) -> str:
    """Let a :func:`start_gated_run` job go on; wait up to 120 s for it to end and return its output."""
    (tmp_path / "go").touch()
    try:
        output, _ = launcher.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        launcher.kill()
        raise
    return output


# --- one rank's sharded model (run inside run_in_pool) ------------------------------------------------------


def built_in_mode(mode: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.nn.Module, int]:
    """TinyLM + AdamW in ``mode`` on this rank's group, as the Trainer builds them: (model, optimizer,
    the wrapped model that trains, rank)."""
    import torch.distributed as dist
    from tiny_lm import TinyLM

    from ddpkit.config.parallel import ParallelConfig
    from ddpkit.config.schema import DDPConfig
    from ddpkit.parallel.layout import data_parallel_for

    torch.manual_seed(0)
    runtime, way = cpu_runtime(), data_parallel_for(ParallelConfig(mode=mode))
    model = way.shard(TinyLM(vocab=16, dim=12, depth=2, heads=2, max_len=8), mesh=None, runtime=runtime)
    optimizer = way.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    return model, optimizer, way.wrap(model, runtime, DDPConfig()), dist.get_rank()


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer tensor by name, whole, gathered from whichever rank holds it."""
    import torch.distributed as dist

    from ddpkit.checkpoint.sharded import ShardedParts, split_tensors

    tensors, _ = split_tensors(ShardedParts(model, optimizer).state_dict())
    flat = {}

    def walk(prefix: str, tree: dict) -> None:
        for key, value in tree.items():
            if isinstance(value, dict):
                walk(f"{prefix}{key}.", value)
            else:
                whole = value.full_tensor() if hasattr(value, "full_tensor") else value.detach().clone()
                flat[f"{prefix}{key}"] = whole

    walk("", tensors)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, flat)
    return {k: v for part in gathered for k, v in part.items()}  # zero1: each rank owns some optimizer entries


def train_and_save_sharded(tmp: str, mode: str) -> dict[str, torch.Tensor]:
    """Three AdamW steps in ``mode``, then a sharded checkpoint of step 3 in ``tmp``; the full state saved."""
    from torch.nn import functional as F

    from ddpkit.checkpoint.sharded import ShardedParts, save_sharded, split_tensors

    model, optimizer, wrapped, rank = built_in_mode(mode)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x = torch.randint(0, 16, (4, 6), generator=g)
        F.cross_entropy(wrapped(x), x[:, 0]).backward()
        optimizer.step()
        optimizer.zero_grad()
    optimizer.param_groups[0]["lr"] = 0.005  # a scheduled rate must come back too
    tensors, rest = split_tensors(ShardedParts(model, optimizer).state_dict())
    save_sharded(tensors, {**rest, "progress": {"step": 3}}, tmp, step=3, rank=rank, keep_last=2)
    return full_state(model, optimizer)


class RaggedSequences(torch.utils.data.Dataset):
    """Token sequences of random length (3..16), padded to 16 with targets -100: a token-weighted loss matters."""

    def __init__(self, n: int = 64, seq_len: int = 16, vocab: int = 50):
        g = torch.Generator().manual_seed(7)
        self.x = torch.randint(0, vocab, (n, seq_len), generator=g)
        self.y = torch.randint(0, vocab, (n, seq_len), generator=g)
        lengths = torch.randint(3, seq_len + 1, (n,), generator=g)
        self.y[torch.arange(seq_len)[None, :] >= lengths[:, None]] = -100

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def launch_with_a_restart(
    out: Path, cfg: dict, *, script: str, nproc: int, env: dict[str, str], timeout: float = 400
) -> str:
    """``cfg`` written to ``out/exp.yaml`` and run by ``ddpkit run`` with ``script`` on ``nproc`` ranks, one restart
    allowed (a script that kills itself on request: KILL_RANK / KILL_AT_STEP in ``env``); its stderr. Fails the
    test unless the run ends with exit code 0."""
    out.mkdir(parents=True)
    (out / "exp.yaml").write_text(yaml.safe_dump(cfg))
    args = ["run", str(out / "exp.yaml"), "--nproc-per-node", str(nproc), "--max-restarts", "1", "--script", script]
    done = run_cli(*args, env=env, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


def trained_log(run_dir: Path, rank: int) -> list[tuple[int, int, str]]:
    """``(attempt, step, fingerprint)`` of each line of ``run_dir/trained-rank<rank>.log``, which the killable
    test scripts (tests/scripts/pipeline_trainer.py, tensor_trainer.py) append after each optimizer step."""
    lines = (run_dir / f"trained-rank{rank}.log").read_text().splitlines()
    return [(int(attempt), int(step), fingerprint) for attempt, step, fingerprint in map(str.split, lines)]


def assert_same_samples_after_restart(killed: Path, clean: Path, rank: int, *, resumed_at: int) -> None:
    """The killed run trained, before its restart up to the checkpoint and after it from step ``resumed_at``, the
    very steps and samples the clean run trained (their trained logs, :func:`trained_log`)."""
    trained = trained_log(killed, rank)
    first = [(step, fp) for attempt, step, fp in trained if attempt == 0 and step < resumed_at]
    again = [(step, fp) for attempt, step, fp in trained if attempt == 1]
    assert again[0][0] == resumed_at, trained
    assert first + again == [(step, fp) for _, step, fp in trained_log(clean, rank)]
