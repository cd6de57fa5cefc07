"""The Llama modes of benchmarks/gpu_session.sh on the CPU: the same commands with tiny shapes, and their time limits.

The figures need a GPU (benchmarks/RESULTS.md); here ``gpu_bound --workload llama1b`` (full, LoRA and the
document mask, both sides), ``gpu_generate`` and the session script's plan, smoke run and time limits run
with tiny shapes, so a session that is lent a GPU finds commands that work.

    .venv/bin/pytest tests/test_gpu_session.py                  # the fast cases
    .venv/bin/pytest tests/test_gpu_session.py -m slow          # the whole llama part on the CPU; a hung mode killed
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import REPO

from ddpkit.models.generation import generate

pytestmark = pytest.mark.timeout(300)
SESSION = REPO / "benchmarks" / "gpu_session.sh"
MODES = ("llama-eager", "llama-generate", "llama-compiled", "llama-documents")


def _session(*args: str, timeout: float = 280, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SESSION), *args],
        cwd=REPO,
        env={**os.environ, "PYTHON": sys.executable, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_the_tiny_llama_trains_the_same_job_on_both_sides_full_with_lora_and_with_documents(tmp_path):
    """In the slow set: it starts benchmarks.gpu_bound as a process that trains six arms of a tiny Llama, and the fast
    set keeps test_an_arm_that_fails_is_reported_and_the_others_still_run for the comparison and its table."""
    out = tmp_path / "runs.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.gpu_bound",
            *("--workload", "llama1b", "--tiny", "--device", "cpu", "--mode", "eager"),
            *("--variants", "lora,documents", "--rounds", "1", "--warmup", "2", "--seconds", "0.2", "--json", str(out)),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    runs = {arm: results[0] for arm, results in result["runs"].items()}
    assert result["complete"] and result["args"]["variants"] == ["full", "lora", "documents"]
    assert sorted(runs) == sorted(f"{s}-eager{v}" for s in ("hand", "ddpkit") for v in ("", "-lora", "-documents"))
    losses = {arm: run["losses"] for arm, run in runs.items()}
    for variant in ("", "-lora", "-documents"):
        # Same seed, batches, model (adapter and mask included) and optimizer: bitwise equal on the CPU.
        hand, ddpkit = losses[f"hand-eager{variant}"], losses[f"ddpkit-eager{variant}"]
        assert len(hand) >= 3 and hand[: len(ddpkit)] == ddpkit[: len(hand)]
    full, lora, documents = losses["hand-eager"], losses["hand-eager-lora"], losses["hand-eager-documents"]
    # The adapter starts at zero (B = 0): the first step is the base's; then only the adapter learns.
    assert lora[0] == full[0] and lora[1:3] != full[1:3]
    # Documents of ~8 tokens in windows of 32: the mask changes the very first loss.
    assert documents[0] != full[0]
    assert "x full" in proc.stdout and "lora: model.lora" in proc.stdout and "documents of ~8 tokens" in proc.stdout


def test_an_arm_that_fails_is_reported_and_the_others_still_run(monkeypatch):
    gpu_bound = importlib.import_module("benchmarks.gpu_bound")
    args = gpu_bound.parse(
        ["--workload", "llama1b", "--tiny", "--device", "cpu", "--variants", "lora", "--rounds", "2", "--mode", "eager"]
    )
    args.batch_size = 4
    w = gpu_bound.TINY["llama1b"]

    def arm(side, job, data, args, *, compiled, workdir, checkpoint=None):
        # a stand-in for one arm: the LoRA arms run out of memory, the others measure 100 tokens/s (LoRA: none)
        if "lora" in job.model:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return {"step_ms": [10.0, 11.0], "per_s": 100.0, "warmup_s": 0.1, "losses": [1.0], "peak_bytes": None}

    monkeypatch.setattr(gpu_bound, "run_arm", arm)
    saved = []
    runs = gpu_bound.compare(w, gpu_bound.make_data(w, torch.device("cpu")), args, Path("."), saved=saved.append)
    assert len(saved) == 8 and sorted(runs) == ["ddpkit-eager", "ddpkit-eager-lora", "hand-eager", "hand-eager-lora"]
    assert all("OutOfMemoryError" in r["error"] for r in runs["ddpkit-eager-lora"] + runs["hand-eager-lora"])
    printed = gpu_bound.throughput_table(w, runs, args, {"full": None}, None)
    rows = {line.split()[0]: line.split() for line in printed.splitlines()[3:] if line.strip()}
    assert rows["ddpkit-eager"][1] == "100" and rows["ddpkit-eager-lora"][1] == "failed"
    assert "failed: hand-eager-lora round 2: OutOfMemoryError" in printed


def test_generation_at_a_batch_is_generate_for_each_prompt_and_the_cache_changes_no_token(tmp_path):
    gpu_generate = importlib.import_module("benchmarks.gpu_generate")
    args = gpu_generate.parse(["--device", "cpu", "--tiny", "--weights", "fp32", "--rounds", "1", "--batches", "1,3"])
    model = gpu_generate.build(args)["fp32"]
    prompts = torch.randint(0, model.vocab_size, (3, args.prompt_len), generator=torch.Generator().manual_seed(0))
    for cache in (True, False):
        batch = gpu_generate.batched_greedy(model, prompts, args.new_tokens, cache=cache, autocast=None)
        each = [list(generate(model, p.tolist(), max_new_tokens=args.new_tokens, temperature=0)) for p in prompts]
        assert batch.tolist() == each
    out = tmp_path / "generate.json"
    assert gpu_generate.main(["--device", "cpu", "--tiny", "--rounds", "1", "--json", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["complete"] and len(written["rates"]) == 8
    assert all(rates and rates[0] > 0 for rates in written["rates"].values())
    assert all(a["loop_vs_generate"] == a["tokens"] for a in written["agree"].values())


def test_the_llama_part_plans_four_time_boxed_modes_within_eight_minutes(tmp_path):
    plan = _session("llama", str(tmp_path), DRY_RUN="1")
    assert plan.returncode == 0, plan.stderr
    smoke = _session("llama", str(tmp_path), DRY_RUN="1", SMOKE="1")
    assert not list(tmp_path.iterdir())  # a plan writes nothing
    budget = int(plan.stdout.split("budget ")[1].split()[0])
    assert budget <= 8 * 60
    expected = 0
    for mode in MODES:
        line = next(line for line in plan.stdout.splitlines() if line.strip().startswith(f"[gpu_session]   {mode}:"))
        expected += int(line.split("expected ~")[1].split()[0])
        assert f"{tmp_path}/{mode}.txt" in line and f"{tmp_path}/{mode}.json" in line
    assert expected <= budget
    gpu = [line for line in plan.stdout.splitlines() if " -m benchmarks." in line]
    cpu = [line for line in smoke.stdout.splitlines() if " -m benchmarks." in line]
    # The smoke runs the GPU's commands, its own options appended (argparse keeps an option's last value).
    assert len(gpu) == len(cpu) == 4
    for on_gpu, on_cpu in zip(gpu, cpu):
        assert "--device cuda" in on_gpu and "--tiny" not in on_gpu
        assert on_cpu.startswith(on_gpu.split(" --device cuda")[0])
        assert "--device cpu --tiny" in on_cpu


@pytest.mark.slow
def test_the_llama_part_runs_every_mode_on_the_cpu_with_tiny_shapes(tmp_path):
    proc = _session("llama", str(tmp_path), SMOKE="1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = (tmp_path / "llama-summary.txt").read_text().splitlines()
    assert [line.split()[:2] for line in summary] == [[mode, "ok"] for mode in MODES]
    for mode in MODES:
        assert json.loads((tmp_path / f"{mode}.json").read_text())["complete"]
        assert "load average after" in (tmp_path / f"{mode}.txt").read_text()
    assert (tmp_path / "machine-llama.txt").exists()


@pytest.mark.slow
def test_a_hung_mode_is_killed_at_its_limit_and_the_budget_left_decides_the_rest(tmp_path):
    hang = tmp_path / "python"
    # a python that hangs in every benchmark, ignoring SIGTERM, and is itself elsewhere (the machine's lines)
    hang.write_text(
        f"#!/usr/bin/env bash\nif [[ $1 == -m ]]; then trap '' TERM; sleep 600; fi\nexec {sys.executable} \"$@\"\n"
    )
    hang.chmod(0o755)
    out = tmp_path / "out"
    proc = _session("llama", str(out), SMOKE="1", PYTHON=str(hang), GPU_SESSION_BUDGET_S="40", timeout=120)
    assert proc.returncode == 1
    summary = (out / "llama-summary.txt").read_text().splitlines()
    # the limit: what the 40 s budget leaves after the machine's lines and the 5 s kept back
    name, _, rest = summary[0].partition(" stopped at its ")
    limit = int(rest.split()[0])
    assert name == "llama-eager" and 30 <= limit <= 35 and rest.split()[1:5] == ["s", "limit", "(rc", "137)"]
    assert limit <= int(summary[0].split()[-2]) <= limit + 2
    assert [line.split()[:2] for line in summary[1:]] == [[mode, "skipped"] for mode in MODES[1:]]
