"""Warm restarts under ``ddpkit run`` (issue 47): the script's libraries are imported once, in the launcher; the
one-node rendezvous completes at once; every fault's cost is split in ``ddpkit goodput``.

    .venv/bin/pytest -q tests/test_warm_restart.py

The fast tests read scripts with ast, classify exit codes and split synthetic ledgers. The end-to-end test
kills a worker of ``tests/scripts/sklearn_trainer.py`` (a script that imports scikit-learn at its top) and
checks, from inside the workers, that scikit-learn was already imported on both attempts; that the restart
re-trained no step and ends bitwise equal to an uninterrupted run started with ``DDPKIT_PRELOAD=off`` (which
imports it itself); and that ``ddpkit goodput`` names the fault and splits it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers import assert_bitwise_equal, load_weights, run_cli, tiny_config

from ddpkit.goodput.faults import AGENT_EVENT, PARTS, fault_costs, fault_kind
from ddpkit.launch.warm_imports import PRELOAD_ENV, installed, preload_program, script_imports

SCRIPT = "tests/scripts/sklearn_trainer.py"


def test_a_scripts_top_level_imports_are_read_without_running_it(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "from __future__ import annotations\nimport os, json as j\nimport numpy.linalg\n"
        "from sklearn.datasets import make_classification, load_iris\nfrom . import sibling\n"
        "if True:\n    import csv\ndef f():\n    import decimal\nraise SystemExit('never run')\n"
    )
    assert script_imports([str(script), "exp.yaml"]) == [
        "os",
        "json",
        "numpy.linalg",
        "sklearn.datasets",
        "sklearn.datasets.make_classification",
        "sklearn.datasets.load_iris",
    ]  # module level only: not the `if`'s, not the function's, not the relative one
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__main__.py").write_text("import email\n")
    sys.path.insert(0, str(tmp_path))  # `-m`: found on sys.path or in the working directory, never imported
    try:
        assert script_imports(["-m", "pkg", "x"]) == ["email"]
        (tmp_path / "mine.py").write_text("")
        assert not installed("mine")  # the user's own folder: never preloaded
        assert installed("json") and installed("numpy.linalg") and installed("sys")
    finally:
        sys.path.remove(str(tmp_path))
    script.write_text("import os\nDDPKIT_PRELOAD = False\n")
    assert script_imports([str(script)]) == []
    assert script_imports([str(tmp_path / "missing.py")]) == []


def test_preloading_imports_installed_modules_skips_failures_and_honours_the_opt_out(tmp_path, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text("import colorsys\nimport no_such_module_here\nfrom json import dumps\nimport mine\n")
    (tmp_path / "mine.py").write_text("raise RuntimeError('the user module ran in the launcher')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("colorsys", "mine"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setenv(PRELOAD_ENV, "off")
    assert preload_program([str(script)]) == [] and "colorsys" not in sys.modules
    monkeypatch.setenv(PRELOAD_ENV, "auto")
    assert preload_program([str(script)]) == ["colorsys", "json"]  # a missing module is the worker's to report
    assert "mine" not in sys.modules
    monkeypatch.setenv(PRELOAD_ENV, "wave")  # a list: these too, whatever their origin
    assert preload_program([str(script)]) == ["colorsys", "json", "wave"]


@pytest.mark.parametrize(
    ("codes", "kind"),
    [
        ({0: -15, 1: -9}, "worker killed (SIGKILL)"),
        ({0: 1, 1: -9}, "worker killed (SIGKILL)"),
        ({0: -9, 1: -9}, "every worker killed (SIGKILL)"),
        ({0: 75, 1: -15}, "stop signal"),
        ({0: 1, 1: -15}, "worker failed (exit 1)"),
        ({0: -15, 1: -15}, "worker terminated (SIGTERM)"),
    ],
)
def test_a_faults_kind_comes_from_its_workers_exit_codes(codes, kind):
    assert fault_kind(codes, requeue_exit_code=75) == kind


def _record(event: str, t: float, attempt: int, **fields) -> dict:
    return {"event": event, "t": t, "session": "s1", "attempt": attempt, "rank": 0, **fields}


def test_each_fault_is_split_from_the_last_step_before_it_to_the_first_step_after_it():
    records = [
        _record("launch", 100.0, 0),
        _record("start", 101.0, 0),
        _record("restore", 102.0, 0, began=101.8, step=0, source="none"),
        _record("first_step", 102.1, 0, step=1),
        _record("progress", 103.1, 0, step=40),
        _record("end", 104.0, 0, step=50, last_step_t=103.5, status="FAILED", rank=1),  # the survivor's
        _record(AGENT_EVENT, 103.62, 0, detected=103.52, kind="worker killed (SIGKILL)", codes={"0": -9}, rank=-1),
        _record("start", 103.65, 1),
        _record("restore", 103.80, 1, began=103.75, step=50, source="disk"),
        _record("first_step", 103.81, 1, step=51),
        _record("progress", 104.9, 1, step=90),  # then every worker dies
        _record(AGENT_EVENT, 105.3, 1, detected=105.2, kind="every worker killed (SIGKILL)", codes={}, rank=-1),
        _record("start", 105.4, 2),
        _record("restore", 105.6, 2, began=105.5, step=80, source="memory"),
        _record("first_step", 105.7, 2, step=81),
        _record("end", 106.0, 2, step=100, last_step_t=106.0, status="FINISHED"),
    ]
    one, every = fault_costs(records)
    assert (one.attempt, one.kind, one.steps_lost, one.exact) == ("s1#0", "worker killed (SIGKILL)", 0, True)
    expected = [0.02, 0.10, 0.03, 0.10, 0.05, 0.01]
    assert [one.parts[p] for p in PARTS] == pytest.approx(expected)
    assert one.total == pytest.approx(103.81 - 103.5)
    # Every worker died: steps 50 -> 90 took 1.1 s, so by the agent's detection 0.3 s later about 10 more were done.
    assert (every.kind, every.steps_lost, every.exact) == ("every worker killed (SIGKILL)", 100 - 80, False)
    assert every.parts["detection"] == pytest.approx(105.2 - 104.9)  # from the last progress mark: an upper bound
    plain = [r for r in records if r["event"] != AGENT_EVENT]  # torchrun without ddpkit run: no agent lines
    assert [c.parts["detection"] for c in fault_costs(plain)] == [None, None]
    assert fault_costs(plain)[0].parts["restart"] == pytest.approx(103.65 - 103.5)


def test_the_one_node_rendezvous_completes_each_round_at_once_on_a_fresh_key_space():
    import torch.distributed as dist

    from ddpkit.launch.one_node_rendezvous import OneNodeRendezvous
    from ddpkit.launch.torchrun_adapter import round_info

    handler = OneNodeRendezvous(dist.HashStore(), run_id="r", backend="ddpkit-loopback", info=round_info)
    began = time.monotonic()
    first, second = handler.next_rendezvous(), handler.next_rendezvous()
    assert time.monotonic() - began < 0.1  # torch's c10d handler sleeps up to 0.3 s on its first restart
    assert (first.rank, first.world_size, handler.num_nodes_waiting(), handler.use_agent_store) == (0, 1, 0, False)
    first.store.set("key", "stale")
    assert not second.store.check(["key"])  # a restarted group never reads a failed round's keys
    assert second.bootstrap_store_info.master_addr == "127.0.0.1" and second.bootstrap_store_info.master_port > 0


def _launch(out: Path, env: dict[str, str]) -> None:
    out.mkdir(parents=True)
    cfg = tiny_config(
        out, data={"batch_size": 32}, train={"epochs": 2}, checkpoint={"every_epochs": None, "memory_every_steps": None}
    )
    (out / "exp.yaml").write_text(yaml.safe_dump(cfg))
    proc = run_cli(
        "run",
        str(out / "exp.yaml"),
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--script",
        SCRIPT,
        env={"SKLEARN_SAMPLES": "1200", **env},
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def _imports(out: Path) -> list[tuple[int, int]]:
    logs = [out / "run" / f"imports-rank{rank}.log" for rank in (0, 1)]
    lines = [line.split() for log in logs for line in log.read_text().splitlines()]
    return sorted((int(attempt), int(warm)) for attempt, warm, _ in lines)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_killed_worker_restarts_warm_and_the_run_ends_bitwise_with_the_fault_split(tmp_path):
    """`ddpkit run`'s own restart (`--max-restarts 1`) after rank 1 SIGKILLs itself, with the launcher's preloaded
    imports seen from inside the workers of both attempts."""
    _launch(tmp_path / "cold", {PRELOAD_ENV: "off"})
    assert _imports(tmp_path / "cold") == [(0, 0), (0, 0)]  # opted out: each worker imported scikit-learn itself
    _launch(tmp_path / "warm", {"KILL_RANKS": "1", "KILL_AT_STEP": "7"})
    assert _imports(tmp_path / "warm") == [(0, 1), (0, 1), (1, 1), (1, 1)]  # imported by the launcher, both times
    trained = [line.split() for line in (tmp_path / "warm/run/trained-rank0.log").read_text().splitlines()]
    steps = [int(step) for _, step, _ in trained]
    assert steps == sorted(set(steps)) and steps[:8] == list(range(1, 9))  # no step trained twice
    assert_bitwise_equal(load_weights(tmp_path / "warm/run/model.pt"), load_weights(tmp_path / "cold/run/model.pt"))
    report = json.loads(run_cli("goodput", str(tmp_path / "warm/run"), "--json").stdout)
    [fault] = report["faults"]
    assert (fault["kind"], fault["steps_lost"], fault["exact"]) == ("worker killed (SIGKILL)", 0, True)
    assert all(fault[part] is not None and fault[part] >= 0 for part in PARTS)
    assert sum(fault[part] for part in PARTS) == pytest.approx(fault["total"])
    assert "worker killed (SIGKILL)" in run_cli("goodput", str(tmp_path / "warm/run")).stdout


def test_the_launcher_says_whether_forked_workers_could_use_cuda(monkeypatch):
    from ddpkit.launch.forked import cuda_fork_problem

    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    assert "PYTORCH_NVML_BASED_CUDA_CHECK=1" in cuda_fork_problem()
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    assert cuda_fork_problem() is None  # this CPU test process never initialised CUDA
