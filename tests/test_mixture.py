"""Mixtures of token files (``data.kwargs.sources``): exact shares per global batch, index-free order, resume.

    .venv/bin/pytest tests/test_mixture.py -q

Each test file's window ``w`` of source ``s`` starts with the id ``1000 * (s + 1) + w``, so the
windows a run trained on say which source and which window they came from.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from helpers import REPO, assert_bitwise_equal, load_weights, run_cli

import ddpkit
from ddpkit.data.loaders import build_train_loader
from ddpkit.data.mixture import consumed_tokens, report_passes
from ddpkit.data.mixture_schedule import BatchShares, floor_sum
from ddpkit.data.tokens import tokens
from ddpkit.distributed import DistEnv
from ddpkit.errors import DataError

SEQ = 8


def _source(tmp_path: Path, s: int, windows: int, *, dtype: str = "uint16", name: str | None = None) -> str:
    ids = (np.arange(windows * SEQ + 1) * 7 % 50).astype(dtype)
    ids[:-1:SEQ] = 1000 * (s + 1) + np.arange(windows)
    path = tmp_path / (name or f"source{s}.bin")
    ids.tofile(path)
    return str(path)


def _mixture(tmp_path: Path, sizes=(40, 30, 6), weights=(0.55, 0.3, 0.15), **kwargs):
    sources = [
        {"name": f"s{i}", "path": _source(tmp_path, i, n), "weight": w} for i, (n, w) in enumerate(zip(sizes, weights))
    ]
    return tokens(sources=sources, seq_len=SEQ, **kwargs)


def _steps(loader, steps: int, accum: int = 1) -> list[list[int]]:
    """The first tokens of each step's windows, micro-batch after micro-batch, over epochs."""
    out, epoch = [], 0
    while len(out) < steps:
        loader.sampler.set_epoch(epoch)
        batches = iter(loader)
        for micro in batches:
            if not out or len(out[-1][1]) == accum:
                out.append((len(out), []))
            out[-1][1].append(micro[0][:, 0].tolist())
        epoch += 1
    return [sum(micros, []) for _, micros in out[:steps]]


def test_floor_sum_and_the_schedule_are_exact_closed_forms():
    rng = np.random.default_rng(0)
    for n, m, a, b in rng.integers(1, 80, size=(300, 4)):
        assert floor_sum(int(n), int(m), int(a), int(b)) == sum((int(a) * i + int(b)) // int(m) for i in range(n))
    for weights, g in [((0.55, 0.3, 0.15), 16), ((1, 1, 1), 7), ((3, 1), 5), ((0.01, 0.99), 32), ((5, 0, 2, 3.3), 13)]:
        schedule, share = BatchShares(weights, global_batch_size=g, seed=4), g * np.array(weights) / sum(weights)
        total = np.zeros(len(weights), dtype=np.int64)
        for k in range(2000):
            counts = schedule.counts(k)
            assert counts.sum() == g and np.all(np.abs(counts - share) < 1), (weights, k, counts)
            assert np.array_equal(schedule.before(k), total)
            total += counts
        assert np.all(np.abs(total - 2000 * share) < 4)  # the running totals stay within a few windows
        late = schedule.before(10**12)  # a resume at any step: no replay, still on target (the drift grows as log k)
        assert np.all(np.abs(late - 10**12 * share) < 40), late - 10**12 * share


def test_every_global_batch_holds_each_share_and_a_pass_reads_each_window_once(tmp_path):
    train, _ = _mixture(tmp_path)
    loader = build_train_loader(train, env=DistEnv(), batch_size=16, seed=3)
    steps = _steps(loader, 40)
    share = 16 * np.array([0.55, 0.3, 0.15])
    seen: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for ids in steps:
        counts = np.bincount([i // 1000 - 1 for i in ids], minlength=3)
        assert np.all(np.abs(counts - share) < 1), counts
        for i in ids:
            seen[i // 1000 - 1].append(i % 1000)
    sizes = (40, 30, 6)
    for s, windows in seen.items():  # pass p over source s: a permutation of its windows, then the next
        for start in range(0, len(windows) - sizes[s] + 1, sizes[s]):
            assert sorted(windows[start : start + sizes[s]]) == list(range(sizes[s]))
    other = _steps(build_train_loader(train, env=DistEnv(), batch_size=16, seed=4), 40)
    assert other != steps and _steps(build_train_loader(train, env=DistEnv(), batch_size=16, seed=3), 40) == steps


def test_the_same_global_batches_at_any_world_size_and_with_workers(tmp_path):
    train, _ = _mixture(tmp_path)
    one = _steps(build_train_loader(train, env=DistEnv(), batch_size=16, global_batch_size=16, seed=1), 12)
    per_rank = [
        _steps(
            build_train_loader(
                train,
                env=DistEnv(rank=r, world_size=2),
                batch_size=4,
                global_batch_size=16,
                grad_accum_steps=2,
                seed=1,
                num_workers=w,
            ),
            12,
            accum=2,
        )
        for r, w in ((0, 0), (1, 2))
    ]
    for k in range(12):
        assert sorted(per_rank[0][k] + per_rank[1][k]) == sorted(one[k])


def test_passes_are_logged_and_a_repeat_is_refused_when_switched_off(tmp_path, caplog):
    train, _ = _mixture(tmp_path)
    plan = build_train_loader(train, env=DistEnv(), batch_size=16, seed=0).dataset
    with caplog.at_level(logging.INFO, logger="ddpkit"):
        report_passes(plan, total_steps=4)  # 64 windows: s0 35 of 40, s1 19 of 30, s2 10 of 6
    assert "s0 35 windows of 40 (0.88 passes)" in caplog.text
    assert "s2 10 windows of 6 (1.67 passes, repeated)" in caplog.text
    train, _ = _mixture(tmp_path, repeat=False)
    plan = build_train_loader(train, env=DistEnv(), batch_size=16, seed=0).dataset
    report_passes(plan, total_steps=1)  # one step reads 2 or 3 of s2's 6 windows: fine
    with pytest.raises(
        DataError,
        match=r"data.kwargs.sources\[2\] \(s2\): the run reads 10 windows of its 6 "
        r"\(1.67 passes\) and data.kwargs.repeat is false",
    ):
        report_passes(plan, total_steps=4)  # 64 windows: s0 35 of 40, s1 19 of 30, s2 10 of 6
    assert consumed_tokens(build_train_loader(train, env=DistEnv(), batch_size=16, seed=0), 5) == {
        f"tokens/s{i}": int(c) * SEQ for i, c in enumerate(plan.windows_before(5))
    }


def test_bad_mixtures_are_one_line_each(tmp_path):
    good = {"name": "a", "path": _source(tmp_path, 0, 5), "weight": 1}
    cases = [
        ([{**good, "weight": 0}], r"data.kwargs.sources: the weights sum to 0.0; give at least one source a positive"),
        ([{**good, "weight": -1}], r"data.kwargs.sources\[0\].weight: expected a number >= 0"),
        (
            [good, {"name": "b", "path": str(tmp_path / "nope.bin"), "weight": 1}],
            r"data.kwargs.sources\[1\] \(b\): no such token file",
        ),
        (
            [good, {"name": "b", "path": _source(tmp_path, 1, 5, dtype="uint32"), "weight": 1, "dtype": "uint32"}],
            r"data.kwargs.sources: the files hold different token dtypes \(a uint16, b uint32\)",
        ),
        ([good, {**good, "wieght": 2}], r"data.kwargs.sources\[1\].wieght: unknown key; did you mean 'weight'\?"),
        ([good, good], r"data.kwargs.sources: the name 'a' is used twice"),
    ]
    for sources, message in cases:
        with pytest.raises(DataError, match=message) as info:
            tokens(sources=sources, seq_len=SEQ)
        assert "\n" not in str(info.value)


def _config(tmp_path: Path, **train) -> dict:
    sources = [
        {"name": f"s{i}", "path": _source(tmp_path, i, n), "weight": w}
        for i, (n, w) in enumerate(((40, 0.5), (30, 0.3), (6, 0.2)))
    ]
    val = [
        {"name": "s0", "path": _source(tmp_path, 0, 5, name="v0.bin")},
        {"name": "s2", "path": _source(tmp_path, 2, 3, name="v2.bin")},
    ]
    return {
        "run": {"name": "mix", "output_dir": str(tmp_path / "run"), "seed": 0},
        "data": {
            "name": "tokens",
            "global_batch_size": 8,
            "kwargs": {"seq_len": SEQ, "sources": sources, "val_sources": val},
        },
        "model": {"name": "gpt", "kwargs": {"vocab_size": 4096, "dim": 32, "depth": 1, "heads": 2, "max_len": SEQ}},
        "optim": {"name": "adamw", "lr": 0.01},
        "train": {"max_steps": 8, "log_every": 1, "eval_every": 4, "loss_normalization": "tokens", **train},
        "checkpoint": {"every_steps": 2},
        "log": {"progress_bar": False},
        "dist": {"timeout": 60},
    }


def _windows(run: Path) -> dict[int, list[int]]:
    """Step -> the windows every rank trained on in it (a restarted attempt's replay overwrites)."""
    per_rank: dict[str, dict[int, list[int]]] = {}
    for file in sorted(run.glob("windows-rank*.txt")):
        attempts: dict[int, dict[int, list[int]]] = {}
        for line in file.read_text().splitlines():
            attempt, step, *ids = map(int, line.split())
            attempts.setdefault(attempt, {}).setdefault(step, []).extend(ids)
        per_rank[file.name] = {}
        for attempt in sorted(attempts):  # a restarted attempt's replayed steps replace the first attempt's
            per_rank[file.name].update(attempts[attempt])
    steps = sorted(set().union(*per_rank.values()))
    return {step: sorted(sum((r.get(step, []) for r in per_rank.values()), [])) for step in steps}


def _launch(tmp_path: Path, nproc: int, *overrides: str, env: dict | None = None, **train) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = tmp_path / "mix.yaml"
    cfg.write_text(yaml.safe_dump(_config(tmp_path, **train)))
    done = run_cli(
        "run",
        str(cfg),
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        "1",
        "--script",
        "tests/scripts/mixture_trainer.py",
        *overrides,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp_path / "run"


@pytest.mark.slow
def test_a_killed_run_and_one_resumed_on_another_world_size_train_on_the_same_windows(tmp_path):
    """`ddpkit run`'s own restart (`--max-restarts 1`) after rank 1 SIGKILLs itself, then a new command on another world
    size that resumes the run. In the slow set: it runs four `ddpkit run` jobs, one of them restarted, and the fast set
    keeps test_mixture_tiny_runs_on_two_ranks and test_the_same_global_batches_at_any_world_size_and_with_workers."""
    clean = _launch(tmp_path / "clean", 2)
    killed = _launch(tmp_path / "killed", 2, env={"KILL_RANK": "1", "KILL_AT_STEP": "5"})
    assert _windows(killed) == _windows(clean)
    assert_bitwise_equal(load_weights(killed / "model.pt"), load_weights(clean / "model.pt"))
    grown = _launch(tmp_path / "grown", 1, max_steps=4)  # 4 steps on one rank, then 4 more on two
    grown = _launch(tmp_path / "grown", 2)
    assert _windows(grown) == _windows(clean)
    records = [json.loads(line) for line in (clean / "metrics.jsonl").read_text().splitlines()]
    validation = [r for r in records if "val_loss" in r][-1]
    assert {"val_loss/s0", "val_loss/s2"} <= set(validation)
    assert min(validation["val_loss/s0"], validation["val_loss/s2"]) <= validation["val_loss"]
    assert validation["val_loss"] <= max(validation["val_loss/s0"], validation["val_loss/s2"])


def test_validation_reports_each_source_and_the_token_weighted_loss(tmp_path):
    cfg = _config(tmp_path, max_steps=2, eval_every=None)
    cfg["checkpoint"] = {"every_steps": None}
    metrics = ddpkit.Trainer(cfg).fit()
    model = ddpkit.Trainer(cfg).build_model()
    model.load_state_dict(torch.load(tmp_path / "run" / "model.pt", weights_only=True))
    _, val = tokens(**cfg["data"]["kwargs"])
    losses = {"s0": [], "s2": []}
    with torch.no_grad():
        for i in range(len(val)):
            x, y, name = val[i]
            losses[name] += torch.nn.functional.cross_entropy(model(x[None])[0], y, reduction="none").tolist()
    for name, values in losses.items():
        assert metrics[f"val_loss/{name}"] == pytest.approx(np.mean(values), rel=1e-5)
    assert metrics["val_loss"] == pytest.approx(np.mean(losses["s0"] + losses["s2"]), rel=1e-5)


def test_mixture_tiny_runs_on_two_ranks(tmp_path):
    """The shipped configs/mixture_tiny.yaml as its header tells users to run it, `ddpkit run configs/mixture_tiny.yaml
    --nproc-per-node 2`, from a directory holding its token files."""
    from ddpkit.tools.tokenize import tokenize

    made = {
        "code": ["ddpkit/data/mixture.py", "ddpkit/data/tokens.py"],
        "docs": ["docs/lm.md"],
        "configs": ["configs/lm_tiny.yaml"],
        "code_val": ["tests/test_mixture.py"],
        "docs_val": ["docs/data.md"],
    }
    for name, inputs in made.items():
        tokenize([str(REPO / i) for i in inputs], str(tmp_path / "data" / "mix" / f"{name}.bin"), progress=False)
    done = run_cli(
        "run",
        str(REPO / "configs" / "mixture_tiny.yaml"),
        "--nproc-per-node",
        "2",
        "train.max_steps=4",
        "train.eval_every=4",
        f"run.output_dir={tmp_path / 'run'}",
        "log.progress_bar=false",
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "configs" in done.stderr and "passes, repeated" in done.stderr
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {"val_loss", "val_loss/code", "val_loss/docs"} <= set([r for r in records if "val_loss" in r][-1])
