"""``ddpkit bench scaling``: the cost model's formulas by hand, the bucket profile on a real rank, the CLI end to end.

The formulas are checked on cases worked out on paper (no processes). The profile runs the real
config step on a one-rank Gloo group in this process and is compared with DDP's own record of
its rebuilt buckets. The end-to-end test runs ``python -m ddpkit bench scaling`` with tiny sizes,
real launched profiles and a real 2-rank training run, and checks the tables' structure and
arithmetic, never how fast anything was.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml
from helpers import parse_table, run_cli, tiny_config
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit.bench import main as bench_main
from ddpkit.bench.scaling_model import (
    Bucket,
    Link,
    Param,
    Profile,
    allreduce_s,
    assign_buckets,
    best_bucket_cap,
    broadcast_s,
    comm_end_s,
    fit_link,
    parse_bandwidth,
    parse_latency,
    predict,
    ring_allreduce_s,
    straggler_s,
    tree_allreduce_s,
)
from ddpkit.bench.units import BenchUsageError

MIB = 1 << 20
GB_LINK = Link(bandwidth=1e9, latency=1e-5)  # 1 GB/s, 10 us per step


def profile(**fields) -> Profile:
    base = {
        "batch_size": 8,
        "data_s": 0.001,
        "forward_s": 0.002,
        "backward_s": 0.0025,
        "optimizer_s": 0.0005,
        "local_backward_s": 0.0,
        "single_step_s": 0.005,
        "buckets": (Bucket(1_000_000, 0.001), Bucket(1_000_000, 0.002)),
    }
    return Profile(**{**base, **fields})


# --- the cost model, by hand --------------------------------------------------------------------


def test_ring_and_tree_allreduce_match_hand_computed_times():
    # ring, 4 ranks, 1 MB: 2*3/4 * 1e6 / 1e9 = 1.5 ms of transfer, 2*3 = 6 steps of 10 us.
    assert math.isclose(ring_allreduce_s(1e6, 4, GB_LINK), 1.5e-3 + 6e-5)
    # tree, 4 ranks: 2*log2(4) = 4 hops of 10 us, 2 * 1e6 / 1e9 = 2 ms of transfer.
    assert math.isclose(tree_allreduce_s(1e6, 4, GB_LINK), 2e-3 + 4e-5)
    assert allreduce_s(1e6, 4, GB_LINK, "best") == ring_allreduce_s(1e6, 4, GB_LINK)
    # Small messages on many ranks: the ring's 2046 latency steps lose to the tree's 20 hops.
    assert math.isclose(ring_allreduce_s(1000, 1024, GB_LINK), 2 * 1023 / 1024 * 1e-6 + 2046e-5)
    assert math.isclose(tree_allreduce_s(1000, 1024, GB_LINK), 20e-5 + 2e-6)
    assert allreduce_s(1000, 1024, GB_LINK, "best") == tree_allreduce_s(1000, 1024, GB_LINK)
    assert ring_allreduce_s(1e9, 1, GB_LINK) == tree_allreduce_s(1e9, 1, GB_LINK) == 0.0
    # Buffer broadcast on 8 ranks: 3 hops of (10 us + 1e5 B / 1 GB/s = 100 us).
    assert math.isclose(broadcast_s(1e5, 8, GB_LINK), 3 * 1.1e-4)


def test_fit_recovers_latency_and_bandwidth_from_exact_ring_times():
    truth = Link(bandwidth=0.45e9, latency=3.7e-4)
    points = [(b, n, ring_allreduce_s(b, n, truth)) for b in (4096, 65536, 1 << 20, 16 << 20) for n in (2, 3)]
    fitted = fit_link(points)
    assert math.isclose(fitted.latency, truth.latency, rel_tol=1e-6)
    assert math.isclose(fitted.bandwidth, truth.bandwidth, rel_tol=1e-6)
    with pytest.raises(BenchUsageError, match="two different message sizes"):
        fit_link([(4096, 2, 1e-3)])


def test_overlap_waits_for_the_previous_bucket_and_for_readiness():
    link = Link(bandwidth=1e9, latency=0.0)  # 1 MB takes 1 ms on 2 ranks
    # Bucket 0 ready at 1 ms ends at 2 ms; bucket 1 ready at 2 ms starts then and ends at 3 ms.
    assert comm_end_s([Bucket(1_000_000, 0.001), Bucket(1_000_000, 0.002)], 2, link) == pytest.approx((0.003, 0.002))
    # Bucket 1 ready early must still wait for bucket 0's allreduce to end: 1+1, then +1.
    assert comm_end_s([Bucket(1_000_000, 0.001), Bucket(1_000_000, 0.0011)], 2, link)[0] == pytest.approx(0.003)
    # A comm hook halving the bytes (fp16) halves each allreduce.
    assert comm_end_s([Bucket(1_000_000, 0.001)], 2, link, comm_factor=0.5)[0] == pytest.approx(0.0015)


def test_step_time_is_compute_plus_the_longer_of_backward_and_communication():
    link = Link(bandwidth=1e9, latency=0.0)
    p = predict(profile(), 2, link)
    # data 1 + forward 2 + optimizer 0.5 + max(backward 2.5, comm end 3) = 6.5 ms; 0.5 ms exposed.
    assert (
        p.step_s == pytest.approx(0.0065)
        and p.exposed_comm_s == pytest.approx(0.0005)
        and p.comm_s == pytest.approx(0.002)
    )
    assert p.efficiency == pytest.approx(0.005 / 0.0065) and p.samples_per_s == pytest.approx(2 * 8 / 0.0065)
    hidden = predict(profile(backward_s=0.004), 2, link)  # communication ends before the backward does
    assert hidden.exposed_comm_s == 0 and hidden.step_s == pytest.approx(0.0075)
    one = predict(profile(), 1, link)  # a world of one runs the bare model: no DDP, no communication
    assert (one.step_s, one.efficiency, one.samples_per_s) == (0.005, 1.0, 8 / 0.005)
    # Buffers broadcast at each forward: one hop of 1 MB on 2 ranks, 1 ms.
    assert predict(profile(buffer_bytes=1_000_000), 2, link).step_s == pytest.approx(0.0065 + 0.001)


def test_the_step_waits_for_the_slowest_rank_read_from_the_profiled_spread():
    # 11 iterations of 10..20 ms: the median is 15 ms; the median of the slowest of n is the
    # 0.5^(1/n) quantile: 2 ranks 0.7071 -> 10 + 10 * 0.7071 = 17.07 ms, 3 ranks 0.7937 -> 17.94 ms.
    samples = [0.010 + 0.001 * i for i in range(11)]
    assert straggler_s(samples, 1) == 0.0
    assert straggler_s(samples, 2) == pytest.approx(0.010 * 0.5**0.5 - 0.005)
    assert straggler_s(samples, 3) == pytest.approx(0.010 * 0.5 ** (1 / 3) - 0.005)
    # At 1,024 ranks the quantile is past the largest sample, so the wait stops at max - median.
    assert (
        straggler_s(samples, 1024) == pytest.approx(0.010 * 0.5 ** (1 / 1024) - 0.005)
        and straggler_s(samples, 10**6) <= 0.005
    )
    assert straggler_s(list(reversed(samples)), 2) == straggler_s(samples, 2)  # order does not matter
    assert straggler_s([0.01], 8) == straggler_s([], 8) == 0.0  # no spread known: no wait
    link = Link(bandwidth=1e9, latency=0.0)
    spread = predict(profile(step_samples_s=tuple(samples)), 2, link)
    assert spread.straggler_s == pytest.approx(straggler_s(samples, 2))
    assert spread.step_s == pytest.approx(predict(profile(), 2, link).step_s + spread.straggler_s)
    assert predict(profile(step_samples_s=tuple(samples)), 1, link).step_s == 0.005  # one rank waits for nobody


def test_buckets_are_packed_in_ready_order_as_ddp_rebuilds_them():
    params = [
        Param(512 * 1024, 0.004),
        Param(MIB, 0.001),
        Param(MIB, 0.002),
        Param(3 * MIB, 0.003),
        Param(100, 0.0035, "float16"),
    ]
    # cap 2 MiB: a bucket closes once it holds >= 2 MiB (so the 3 MiB gradient fills one alone); the
    # fp16 gradient gets its own bucket, ready at 3.5 ms but launched only after the bucket before it.
    assert [(b.nbytes, b.ready_s) for b in assign_buckets(params, cap_mb=2)] == [
        (2 * MIB, 0.002),
        (3 * MIB, 0.003),
        (512 * 1024, 0.004),
        (100, 0.004),
    ]
    # torch's default: a 1 MiB first bucket, then 25 MiB.
    assert [b.nbytes for b in assign_buckets(params, cap_mb=None)] == [MIB, 4 * MIB + 512 * 1024, 100]


def test_best_bucket_cap_trades_overlap_against_latency():
    params = tuple(Param(MIB, 0.001 * (i + 1)) for i in range(8))  # 8 MiB of gradients over 8 ms of backward
    p = profile(backward_s=0.008, params=params, buckets=tuple(assign_buckets(params, cap_mb=25)))
    fast_latency = Link(bandwidth=4e9, latency=1e-6)
    assert best_bucket_cap(p, 8, fast_latency, caps_mb=[1, 4, 25])[0] == 1  # small buckets hide communication
    slow_latency = Link(bandwidth=100e9, latency=5e-3)
    assert best_bucket_cap(p, 8, slow_latency, caps_mb=[1, 4, 25])[0] == 25  # each allreduce costs 70 ms of latency


def test_bandwidth_and_latency_units():
    assert parse_bandwidth("100Gbit") == parse_bandwidth("100Gb") == parse_bandwidth("100GbE") == 12.5e9
    assert parse_bandwidth("12.5GB/s") == parse_bandwidth("12.5GBps") == 12.5e9
    assert (
        parse_latency("5us") == pytest.approx(5e-6)
        and parse_latency("0.5ms") == 5e-4
        and parse_latency("800ns") == pytest.approx(8e-7)
    )
    for bad in ("fast", "100", "-1Gbit", "0Gbit", "10 Gbit/h"):
        with pytest.raises(BenchUsageError, match="--link") as info:
            parse_bandwidth(bad)
        assert info.value.exit_code == 2
    with pytest.raises(BenchUsageError, match="--latency"):
        parse_latency("5 parsecs")


def test_horovod_resnet101_check_in_the_docs_is_what_the_model_computes():
    """docs/scaling.md's table: Horovod's ResNet-101 setup (published: 0.90 at 512 GPUs)."""
    from dataclasses import replace
    from pathlib import Path
    from statistics import NormalDist

    from ddpkit.bench.scaling_model import assumed_profile

    resnet101 = assumed_profile(0.618, 44_549_160 * 4, batch_size=64, cap_mb=64)
    ring = [round(predict(resnet101, n, Link(25e9 / 8, 10e-6)).efficiency, 3) for n in (16, 128, 512)]
    assert ring == [0.960, 0.954, 0.943]
    assert round(predict(resnet101, 512, Link(25e9 / 8, 20e-6)).efficiency, 3) == 0.928
    assert round(predict(resnet101, 512, Link(25e9 / 8, 10e-6), "tree").efficiency, 3) == 0.957
    one_bucket = assumed_profile(0.618, 44_549_160 * 4, batch_size=64, cap_mb=1e6)
    assert round(predict(one_bucket, 512, Link(25e9 / 8, 10e-6)).efficiency, 3) == 0.833
    spread = NormalDist(0.618, 0.015 * 0.618)  # the assumed 1.5% step-to-step spread
    jittery = replace(resnet101, step_samples_s=tuple(spread.inv_cdf((i + 0.5) / 1000) for i in range(1000)))
    assert [round(predict(jittery, n, Link(25e9 / 8, 10e-6)).efficiency, 3) for n in (16, 128, 512)] == [
        0.937,
        0.921,
        0.905,
    ]
    docs = (Path(__file__).resolve().parents[1] / "docs" / "scaling.md").read_text()
    assert (
        "| predicted, ring, 10 us | 0.960 | 0.954 | **0.943** |" in docs
        and "| published (Horovod) | | | **0.90** |" in docs
    )
    assert "| predicted, ring, 10 us, 1.5% step spread (**assumed**) | 0.937 | 0.921 | 0.905 |" in docs


# --- the profile on a real rank -----------------------------------------------------------------


def test_profile_records_ddps_own_buckets_in_firing_order(tmp_path):
    from ddpkit.bench.scaling_profile import measure_profile
    from ddpkit.config.loader import load_config
    from ddpkit.distributed.env import DistEnv
    from ddpkit.distributed.process_group import process_group
    from ddpkit.registry import MODELS

    model = {"name": "mlp", "kwargs": {"in_features": 144, "hidden": [64, 64]}}
    cfg = load_config(_write(tmp_path, tiny_config(tmp_path, model=model, ddp={"bucket_cap_mb": 0.005})))
    with process_group(DistEnv()) as runtime:
        prof = measure_profile(cfg, runtime, iters=4, warmup=2)
        reference = DDP(MODELS.build("mlp", key="model.name", kwargs=model["kwargs"]), bucket_cap_mb=0.005)
        for _ in range(3):  # DDP rebuilds its buckets after the first backward
            reference(torch.randn(4, 144)).sum().backward()
        rebuilt = [int(s) for s in reference._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(",")]
    assert [b.nbytes for b in prof.buckets] == rebuilt and len(rebuilt) > 1
    # Regrouping the measured per-gradient times reproduces DDP's layout for the config's cap.
    assert [b.nbytes for b in assign_buckets(prof.params, cap_mb=0.005)] == rebuilt
    launches = [b.ready_s for b in prof.buckets]
    assert launches == sorted(launches) and 0 < launches[-1] <= prof.backward_s
    assert sum(p.nbytes for p in prof.params) == prof.grad_bytes == 4 * sum(p.numel() for p in reference.parameters())
    assert min(prof.data_s, prof.forward_s, prof.optimizer_s, prof.single_step_s) > 0 and prof.local_backward_s == 0
    assert prof.batch_size == 16 and prof.comm_factor == 1.0
    # Every timed iteration's DDP step, sorted: the spread the straggler term reads.
    assert (
        len(prof.step_samples_s) == 4
        and list(prof.step_samples_s) == sorted(prof.step_samples_s)
        and prof.step_samples_s[0] > 0
    )


# --- the command line ---------------------------------------------------------------------------


def _write(tmp_path, cfg) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _allreduce_json(tmp_path) -> str:
    """``ddpkit bench allreduce --json`` output for a link of 0.5 GB/s and 200 us per step."""
    link = Link(bandwidth=0.5e9, latency=2e-4)
    results = [
        {
            "world_size": n,
            "rows": [{"bytes": b, "time_us": ring_allreduce_s(b, n, link) * 1e6} for b in (4096, 1 << 20, 16 << 20)],
        }
        for n in (2, 3)
    ]
    path = tmp_path / "allreduce.json"
    path.write_text(json.dumps(results))
    return str(path)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_scaling_end_to_end(tmp_path):
    config = _write(tmp_path, tiny_config(tmp_path, ddp={"bucket_cap_mb": 0.01}))
    out, plot = tmp_path / "scaling.json", tmp_path / "scaling.png"
    proc = run_cli(
        "bench",
        "scaling",
        config,
        "--predict",
        "4,64",
        "--link",
        "10Gbit",
        "--latency",
        "5us",
        "--validate",
        "2",
        "--iters",
        "4",
        "--warmup",
        "1",
        "--allreduce-json",
        _allreduce_json(tmp_path),
        "-o",
        str(out),
        "--plot",
        str(plot),
        "train.log_every=2",
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = parse_table(proc.stdout)
    assert [(r["link"], r["ranks"]) for r in rows] == [
        ("this machine", "4"),
        ("this machine", "64"),
        ("10Gbit/5us", "4"),
        ("10Gbit/5us", "64"),
    ]
    for row in rows:  # samples/s = ranks x 16 per rank / step time; efficiency in (0, 1]
        assert math.isclose(
            float(row["samples/s"]), int(row["ranks"]) * 16 * 1000 / float(row["ms/step"]), rel_tol=2e-3
        )
        assert 0 < float(row["efficiency"]) <= 1 and 0 < float(row["its efficiency"]) <= 1
    result = json.loads(out.read_text())
    assert len(result["profile"]["step_samples_s"]) == 4  # the one-rank profile's spread, one time per timed iteration
    assert all(row["straggler_ms"] >= 0 for row in result["predictions"])
    assert math.isclose(result["links"][0]["bandwidth"], 0.5e9, rel_tol=1e-6)  # fitted to the given measurement
    assert math.isclose(result["links"][0]["latency"], 2e-4, rel_tol=1e-6)
    (check,) = result["validation"]  # a real 2-rank training run next to the prediction from a 2-rank profile
    assert check["ranks"] == 2 and check["measured_ms"] > 0 and check["predicted_ms"] > 0
    assert math.isclose(check["error"], check["predicted_ms"] / check["measured_ms"] - 1)
    (row,) = parse_table(proc.stdout[proc.stdout.index("validation on this machine") :])
    assert row["ranks"] == "2" and row["within 15%"] in ("yes", "NO")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--predict", "0"], "--predict: 0 is out of range"),
        (["--predict", "8,x"], "--predict"),
        (["--link", "fast"], "--link: cannot read 'fast'"),
        (["--link", "10Gbit,100Gbit", "--latency", "1us,2us,3us"], "--latency: give one latency, or one per --link"),
        (["--latency", "soon", "--link", "10Gbit"], "--latency: cannot read 'soon'"),
        (["--rounds", "0"], "--rounds: 0 must be at least 1"),
        (["--allreduce-json", "/nonexistent.json"], "--allreduce-json: /nonexistent.json is not a file"),
        (["--bucket-caps", "0,5"], "--bucket-caps"),
        (["ddp.comm_hook=powersgd"], "ddp.comm_hook=powersgd"),
        (["train.compile=true"], "train.compile: the scaling profile times the eager step"),
        (["optim.lrr=0.1"], "optim.lrr"),
    ],
)
def test_bad_input_is_a_usage_error_before_any_process_starts(tmp_path, capsys, args, message):
    config = _write(tmp_path, tiny_config(tmp_path))
    assert bench_main(["scaling", config, "--link", "10Gbit", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_validating_several_ranks_on_a_gpu_is_refused_until_profiles_get_a_gpu_each(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = _write(tmp_path, tiny_config(tmp_path))
    assert bench_main(["scaling", config, "--link", "10Gbit", "--validate", "1,2"]) == 2
    assert "--validate: on GPUs only 1 rank can be checked" in capsys.readouterr().err


def test_missing_config_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        bench_main(["scaling", "--predict", "8"])
    assert info.value.code == 2 and "CONFIG" in capsys.readouterr().err
