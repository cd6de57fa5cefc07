"""The benchmarks package (benchmarks/, run as ``python -m benchmarks.NAME``): every module imports, and the shared
workloads' digest, accuracy and hand-written loop do what the benchmarks rely on.

    .venv/bin/pytest tests/test_benchmarks.py
"""

from __future__ import annotations

import hashlib
import importlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

REPO = Path(__file__).resolve().parents[1]
MODULES = sorted(p.stem for p in (REPO / "benchmarks").glob("*.py") if p.stem != "__init__")

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def workloads():
    # benchmarks/ is not installed with ddpkit: pytest's pythonpath (".") finds it in the checkout.
    return importlib.import_module("benchmarks.workloads")


@pytest.mark.parametrize("name", MODULES)
def test_every_benchmark_module_imports_and_is_listed_with_its_command(name, workloads):
    module = importlib.import_module(f"benchmarks.{name}")
    assert module.__doc__
    listed = importlib.import_module("benchmarks").__doc__
    assert f"benchmarks.{name}" in listed
    if name not in ("workloads", "tta_hand"):
        assert f"python -m benchmarks.{name}" in listed and f"python -m benchmarks.{name}" in module.__doc__


def test_no_benchmark_edits_sys_path():
    offenders = [
        str(p) for d in ("benchmarks", "scripts") for p in (REPO / d).rglob("*.py") if "sys.path" in p.read_text()
    ]
    assert offenders == []
    assert not list((REPO / "scripts").glob("bench*.py"))


def test_weights_digest_is_the_sha256_of_names_and_bytes(workloads):
    weights = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.zeros(3)}
    same = {"b": torch.zeros(3), "w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    nudged = {**weights, "w": weights["w"].clone()}
    nudged["w"][1, 2] = torch.nextafter(nudged["w"][1, 2], torch.tensor(100.0))  # one ulp
    renamed = {"c": weights["b"], "w": weights["w"]}
    digest = workloads.weights_digest
    expected = hashlib.sha256(
        b"b" + bytes(12) + b"w" + torch.arange(6, dtype=torch.float32).numpy().tobytes()
    ).hexdigest()
    assert digest(weights) == digest(same) == expected
    assert len({digest(weights), digest(nudged), digest(renamed)}) == 3


def test_accuracy_counts_exactly_and_restores_train_mode(workloads):
    model = torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.eye(2))  # predicts the larger coordinate
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [2.0, 1.0], [0.0, 3.0]])
    y = torch.tensor([0, 1, 1, 0, 0])  # the third and the fifth are wrong: 3/5
    val = workloads.strided_loader(TensorDataset(x, y), 0, 1, batch_size=2)
    model.train()
    assert workloads.accuracy(model, val) == pytest.approx(0.6, abs=0)  # float64 sums: exactly 3/5
    assert model.training
    half = workloads.strided_loader(TensorDataset(x, y), 1, 2)  # rank 1 of 2: samples 1 and 3, both right
    assert [len(b[1]) for b in half] == [2] and workloads.accuracy(model, half) == 1.0


def test_paired_ratios_and_rotation(workloads):
    ratio = workloads.paired([2.0, 3.0, 8.0], [1.0, 2.0, 4.0])
    assert (ratio.median, ratio.min, ratio.max) == (2.0, 1.5, 2.0)
    extra = workloads.paired([1.5, 2.0], [1.0, 1.0], scale=1000, difference=True)
    assert (extra.min, extra.max) == (500.0, 1000.0)
    assert [workloads.rotated("abc", r) for r in range(4)] == [list("abc"), list("bca"), list("cab"), list("abc")]


def test_hand_written_loop_on_one_gloo_rank_is_deterministic_and_stops_on_request(workloads, tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    w = workloads.WORKLOADS["mlp-1"]

    def run(max_steps: int, stop_at: int | None = None) -> tuple[int, list[int], str]:
        torch.manual_seed(workloads.SEED)
        train_set, model = workloads.build(w, 6)
        seen: list[int] = []

        def on_step(step: int) -> bool:
            seen.append(step)
            return step == stop_at

        steps = workloads.train_by_hand(
            model, workloads.loader_for(train_set, 0, 1), rank=0, world_size=1, max_steps=max_steps, on_step=on_step
        )
        return steps, seen, workloads.weights_digest(model.state_dict())

    first, again, stopped = run(6), run(6), run(6, stop_at=2)
    assert first[:2] == (6, [0, 1, 2, 3, 4, 5, 6]) and first == again
    assert stopped[:2] == (2, [0, 1, 2]) and stopped[2] != first[2]
    assert run(9)[:2] == (9, list(range(10)))  # past one epoch of 6 batches: the next epoch, reshuffled
