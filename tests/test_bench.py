"""``ddpkit bench``: every benchmark end to end through the real CLI, the formulas, and bad input.

The end-to-end tests run ``python -m ddpkit bench ...`` with tiny sizes (each world size is a real
job started through torch's launcher) and check the printed table's structure and arithmetic,
never how fast anything was.
"""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch
from helpers import parse_table, run_cli

from ddpkit.bench import main as bench_main
from ddpkit.bench.allreduce import bus_factor
from ddpkit.bench.report import Stats, fmt, format_table
from ddpkit.bench.throughput import efficiency_rows
from ddpkit.bench.units import BenchUsageError, format_bytes, parse_nproc, parse_size, parse_sizes


def close(a: float, b: float, rel: float = 2e-3) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b)) + 1e-12


# --- fast: parsing, formulas, tables --------------------------------------------------------------


def test_sizes_are_1024_based_and_ranges_double():
    assert parse_size("4KB") == parse_size("4k") == parse_size("4KiB") == 4096
    assert parse_size("1.5MB") == 1536 * 1024 and parse_size("512") == parse_size("512B") == 512
    assert parse_sizes("1KB..16KB") == [1024, 2048, 4096, 8192, 16384]
    assert parse_sizes("1KB..10KB") == [1024, 2048, 4096, 8192, 10240]  # the end is always included
    assert parse_sizes("1KB..64KB", factor=4) == [1024, 4096, 16384, 65536]
    assert parse_sizes("1MB,4KB,4KB") == [4096, 1 << 20]
    assert [format_bytes(s) for s in (512, 1024, 1536 * 1024, 1 << 30)] == ["512B", "1KB", "1.5MB", "1GB"]


@pytest.mark.parametrize("text", ["1XB", "KB", "-1KB", "0", "4KB..1KB", "1KB..", ""])
def test_bad_sizes_are_usage_errors(text):
    with pytest.raises(BenchUsageError) as info:
        parse_sizes(text)
    assert info.value.exit_code == 2 and "--sizes" in str(info.value)


def test_nproc_lists():
    assert parse_nproc("2,1,2") == [1, 2]
    for bad in ("0", "a", "1,,x", "", "-2"):
        with pytest.raises(BenchUsageError, match="--nproc"):
            parse_nproc(bad)


def test_bus_bandwidth_factor_and_efficiency_formula():
    assert [bus_factor(n) for n in (1, 2, 4, 8)] == [0.0, 1.0, 1.5, 1.75]
    rows = efficiency_rows({1: Stats.of([10.0]), 2: Stats.of([12.5, 12.0, 13.0])}, batch_size=8)
    assert rows[0]["samples_per_s"] == 800 and rows[0]["efficiency"] == 1.0
    assert rows[1]["samples_per_s"] == 2 * 8 * 1000 / 12.5
    assert rows[1]["efficiency"] == rows[1]["samples_per_s"] / (2 * rows[0]["samples_per_s"]) == 0.8
    assert efficiency_rows({2: Stats.of([5.0])}, batch_size=4)[0]["efficiency"] is None  # no 1-process baseline


def test_table_and_number_formatting():
    table = format_table(["a", "long header"], [["1", "x"], ["22", ""]])
    assert table.splitlines() == [" a  long header", "--  -----------", " 1            x", "22"]
    assert [fmt(v) for v in (0, 1234.6, 12.345, 0.012345, 0.00001234)] == ["0", "1235", "12.35", "0.01235", "1.234e-05"]
    assert parse_table("x\n" + table) == [{"a": "1", "long header": "x"}, {"a": "22", "long header": ""}]


# --- bad input: clear messages, exit code 2, no traceback -------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["throughput", "--model", "resnet81"], "did you mean 'resnet18'"),
        (["throughput", "--model", "mlp", "--nproc-per-node", "0,1"], "--nproc-per-node: 0 is out of range"),
        (
            ["throughput", "--model", "mlp", "--nproc-per-node", "two"],
            "--nproc-per-node: 'two' is not a comma-separated list",
        ),
        (["throughput", "--model", "mlp", "--steps", "0"], "--steps: 0 must be at least 1"),
        (["throughput", "--model", "mlp", "--input-shape", "3,x"], "--input-shape"),
        pytest.param(
            ["throughput", "--model", "mlp", "--precision", "fp16"],
            "--precision fp16 needs a CUDA device",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 is valid on CUDA"),
        ),
        (["allreduce", "--sizes", "1QB..2MB"], "cannot read '1QB' as a size"),
        (["allreduce", "--sizes", "6B"], "not a whole number of float32 elements"),
        (["autotune", "missing.yaml"], "missing.yaml"),
        (["nosuch"], "unknown benchmark 'nosuch'"),
    ],
)
def test_bad_input_is_a_usage_error(argv, message, capsys):
    assert bench_main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_autotune_needs_two_ranks_and_a_valid_config(capsys, tiny_yaml):
    assert bench_main(["autotune", str(tiny_yaml), "--nproc-per-node", "1"]) == 2
    assert "--nproc-per-node: 1 is out of range" in capsys.readouterr().err
    assert bench_main(["autotune", str(tiny_yaml), "optim.lr=-1"]) == 2
    assert "optim.lr" in capsys.readouterr().err


def test_plot_without_matplotlib_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    assert bench_main(["throughput", "--model", "mlp", "--plot", "x.png"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'ddpkit[plot]'" in err and "Traceback" not in err


def test_cli_usage_error_exit_code_and_no_traceback():
    done = run_cli("bench", "allreduce", "--nproc", "2", "--sizes", "4KB..1KB", timeout=120)
    assert done.returncode == 2
    assert "--sizes: '4KB..1KB' runs backwards" in done.stderr and "Traceback" not in done.stderr


# --- end to end through `python -m ddpkit bench` ----------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.slow
def test_allreduce_table_follows_nccl_tests_definitions(tmp_path):
    """In the slow set: it starts a real three-process job, and the fast set keeps
    test_bus_bandwidth_factor_and_efficiency_formula for the bus bandwidth factor."""
    out = tmp_path / "ar.json"
    done = run_cli(
        "bench",
        "allreduce",
        "--nproc-per-node",
        "3",
        "--sizes",
        "4KB..32KB",
        "--iters",
        "3",
        "--warmup",
        "1",
        "-o",
        str(out),
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    assert "gloo on cpu, 3 process(es)" in done.stdout and "[allreduce]" in done.stderr  # progress on stderr
    rows = parse_table(done.stdout)
    assert [r["size"] for r in rows] == ["4KB", "8KB", "16KB", "32KB"]
    for row in rows:
        size, time_us, algbw, busbw = (
            parse_size(row["size"]),
            float(row["time (us)"]),
            float(row["algbw (GB/s)"]),
            float(row["busbw (GB/s)"]),
        )
        assert int(row["count"]) == size // 4 and row["type"] == "float32" and row["check"] == "ok"
        assert close(algbw, size / (time_us * 1e-6) / 1e9, rel=2e-3)  # printed to 4 significant digits
        assert close(busbw, algbw * 2 * (3 - 1) / 3, rel=2e-3)
        assert 1 <= int(row["iters"]) <= 3
    for exact in json.loads(out.read_text())[0]["rows"]:
        assert exact["busbw_gbps"] == pytest.approx(exact["algbw_gbps"] * 4 / 3, rel=1e-12)
        assert exact["algbw_gbps"] == pytest.approx(exact["bytes"] / (exact["time_us"] * 1e-6) / 1e9, rel=1e-12)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_throughput_table_efficiency_and_plot(tmp_path):
    """In the slow set: it starts a real job for each world size (1 and 2 processes), and the fast set keeps
    test_bus_bandwidth_factor_and_efficiency_formula and test_table_and_number_formatting."""
    plot, out = tmp_path / "scaling.png", tmp_path / "tp.json"
    done = run_cli(
        "bench",
        "throughput",
        "--model",
        "mlp",
        "--batch-size",
        "8",
        "--nproc-per-node",
        "1,2",
        "--steps",
        "4",
        "--warmup",
        "1",
        "--plot",
        str(plot),
        "-o",
        str(out),
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    assert "[throughput] round 1/1: mlp on 2 process(es)" in done.stderr
    rows = parse_table(done.stdout)
    assert [(r["nproc"], r["global batch"]) for r in rows] == [("1", "8"), ("2", "16")]
    one, two = (float(r["samples/s"]) for r in rows)
    for row in rows:
        n, ms = int(row["nproc"]), float(row["ms/step"])
        assert close(float(row["samples/s"]), n * 8 * 1000 / ms, rel=2e-3)
    assert rows[0]["efficiency"] == "1.000"
    assert float(rows[1]["efficiency"]) == pytest.approx(two / (2 * one), abs=2e-3)
    exact = json.loads(out.read_text())["rows"]
    assert exact[1]["efficiency"] == pytest.approx(
        exact[1]["samples_per_s"] / (2 * exact[0]["samples_per_s"]), rel=1e-12
    )
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {plot}" in done.stdout


@pytest.mark.multiprocess
@pytest.mark.slow
def test_autotune_reports_every_candidate_and_the_fastest_override(tiny_yaml):
    """In the slow set: it trains each of the four candidates as a real job of several ranks, and the fast set keeps
    test_autotune_needs_two_ranks_and_a_valid_config for its argument checks."""
    done = run_cli(
        "bench",
        "autotune",
        str(tiny_yaml),
        "--steps",
        "2",
        "--warmup",
        "1",
        "--bucket-caps",
        "1",
        "--rounds",
        "1",
        "optim.lr=0.05",
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    rows = parse_table(done.stdout)
    # Candidates: the given cap and the config's (25) x gradient_as_bucket_view false/true.
    assert [(r["bucket_cap_mb"], r["gradient_as_bucket_view"]) for r in rows] == [
        ("1", "false"),
        ("1", "true"),
        ("25", "false"),
        ("25", "true"),
    ]
    assert [r[""] for r in rows].count("fastest") + [r[""] for r in rows].count("fastest, your config") == 1
    assert "your config" in next(
        r[""] for r in rows if (r["bucket_cap_mb"], r["gradient_as_bucket_view"]) == ("25", "true")
    )  # the default
    best = min(rows, key=lambda r: float(r["ms/step"]))
    assert "fastest" in best[""] and best["vs fastest"] == "1.000"
    override = re.search(
        r"^override: (ddp\.bucket_cap_mb=(\S+) ddp\.gradient_as_bucket_view=(true|false))$", done.stdout, re.M
    )
    assert override and (override.group(2), override.group(3)) == (
        best["bucket_cap_mb"],
        best["gradient_as_bucket_view"],
    )
    assert "optim.lr=0.05" in done.stdout  # the user's overrides were applied to every run


def test_overhead_benchmark_compares_final_weights_across_processes_by_digest():
    # benchmarks.overhead --fresh runs every variant in processes of its own: weights are compared by SHA-256.
    from benchmarks import overhead as bench_overhead

    weights = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.zeros(3)}
    same = {"b": torch.zeros(3), "w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    nudged = {**weights, "w": weights["w"].clone()}
    nudged["w"][1, 2] = torch.nextafter(nudged["w"][1, 2], torch.tensor(100.0))  # one ulp
    digest = bench_overhead.weights_digest
    assert digest(weights) == digest(same) != digest(nudged)
    result = {"runs": {"hand-written": {"weights": ["a", "b"]}, "ddpkit": {"weights": ["a", "c"]}}}
    bench_overhead.mark_bitwise(result)
    assert result["runs"]["ddpkit"]["bitwise"] == [True, False] and result["runs"]["hand-written"]["bitwise"] == [
        True,
        True,
    ]
