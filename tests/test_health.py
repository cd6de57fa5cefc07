"""Training health (ddpkit.training.health): NaN steps, loss spikes, stragglers and diverged replicas,
caught and handled by every rank together, on real Gloo ranks with a Trainer that injects the fault.

    .venv/bin/pytest -q tests/test_health.py            # the fast set
    .venv/bin/pytest -q -m slow tests/test_health.py    # plus `ddpkit run` exit codes
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from helpers import REPO, load_script, run_cli, run_in_pool, tiny_config

from ddpkit.checkpoint.files import list_checkpoints
from ddpkit.data.elastic import GlobalBatchSampler
from ddpkit.data.loaders import ResumableDistributedSampler
from ddpkit.errors import HealthError
from ddpkit.training.health_checks import SpikeDetector, fingerprint, sample_indices, slower_ranks

pytestmark = pytest.mark.timeout(180)

SCRIPT = REPO / "tests" / "scripts" / "health_trainer.py"


# --- the arithmetic, no process group -------------------------------------------------------


def test_fingerprint_is_exact_and_order_sensitive_where_a_xor_hash_is_not():
    a = torch.tensor([1.0, 2.0, 3.0])
    assert torch.equal(fingerprint([a]), fingerprint([a.clone()]))
    assert not torch.equal(fingerprint([a]), fingerprint([torch.tensor([2.0, 1.0, 3.0])]))  # swapped values
    assert not torch.equal(fingerprint([a, a * 2]), fingerprint([a * 2, a]))  # swapped tensors
    repeated = torch.tensor([5.0, 5.0, 1.0])  # a XOR reduction cancels the repeated 5.0 and sees only 1.0
    assert not torch.equal(fingerprint([repeated]), fingerprint([torch.tensor([7.0, 7.0, 1.0])]))
    nudged = a.clone()
    nudged[2] = torch.nextafter(nudged[2], torch.tensor(10.0))  # one bit
    assert not torch.equal(fingerprint([a]), fingerprint([nudged]))


def test_spike_detector_waits_for_warmup_then_flags_far_values_only():
    spikes = SpikeDetector(sigma=6, window=8, warmup=4)
    for value in (1.0, 1.1, 0.9, 1.0):
        assert not spikes.is_spike(100.0) or len(spikes.values) >= 4
        spikes.add(value)
    assert not spikes.is_spike(1.2)
    assert spikes.is_spike(100.0)
    state = spikes.state_dict()
    again = SpikeDetector(sigma=6, window=8, warmup=4)
    again.load_state_dict(state)
    assert again.is_spike(100.0) and list(again.values) == list(spikes.values)


def test_slower_ranks_compares_each_rank_with_the_others_median():
    assert slower_ranks([10.0, 13.8], margin=0.25) == [(1, pytest.approx(0.38))]
    assert slower_ranks([0.00045, 0.0006], margin=0.25, floor=1e-3) == []  # 32% slower, but 0.15 ms a step: noise
    assert slower_ranks([0.010, 0.0138], margin=0.25, floor=1e-3) == [(1, pytest.approx(0.38))]
    assert slower_ranks([10.0, 11.0], margin=0.25) == []
    assert slower_ranks([10.0, 10.5, 20.0], margin=0.25) == [(2, pytest.approx(20 / 10.25 - 1))]


def test_sample_indices_replay_the_sampler_without_touching_it():
    data = list(range(40))
    sampler = ResumableDistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=3)
    sampler.set_epoch(2, start_index=8)  # resumed mid-epoch: batch positions still count from the epoch's start
    loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler)
    full = ResumableDistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=3)
    full.set_epoch(2)
    expected = list(full)[8:16]
    assert sample_indices(loader, epoch=2, first_batch=2, count=2) == expected
    assert sampler.start_index == 8 and list(sampler) == list(full)[8:]
    elastic = GlobalBatchSampler(data, global_batch_size=8, rank=0, world_size=2, shuffle=False)
    loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=elastic)
    assert sample_indices(loader, epoch=0, first_batch=1, count=1) == [8, 9, 10, 11]


# --- real ranks ---------------------------------------------------------------------------------


def _fit(tmp: Path, fault: dict[str, str], sections: dict) -> dict:
    """One rank of a HealthTrainer run; the HealthError of a stopped run is returned, not raised."""
    health_trainer = load_script(SCRIPT)
    for name in [n for n in os.environ if n.startswith("HEALTH_")]:
        del os.environ[name]  # one spawn may run several fits
    os.environ.update(fault)
    trainer = health_trainer.HealthTrainer(tiny_config(tmp, **sections))
    try:
        result = {"metrics": trainer.fit(), "error": None}
    except HealthError as exc:
        result = {"metrics": None, "error": str(exc)}
    result["weights"] = {k: v.clone() for k, v in trainer.unwrapped_model.state_dict().items()}
    return result


def _fit_each(runs: list[tuple[Path, dict[str, str], dict]]) -> list[dict]:
    return [_fit(*run) for run in runs]


def _log(tmp: Path) -> str:
    """Rank 0's warnings: the rank files under logs/ (log.rank_files)."""
    return (tmp / "run" / "logs" / "rank0.log").read_text()


def _records(tmp: Path) -> list[dict]:
    """The training records of metrics.jsonl (validation records left out)."""
    lines = (tmp / "run" / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if "train_loss" in record]


def _all_finite_on_disk(tmp: Path) -> bool:
    files = [path for path in [tmp / "run" / "model.pt", *(tmp / "run" / "checkpoints").glob("*.pt")] if path.exists()]
    for path in files:
        state = torch.load(path, weights_only=True)
        weights = state.get("model", state)
        if not all(torch.isfinite(t).all() for t in weights.values() if torch.is_tensor(t)):
            return False
    return bool(files)


LOGGED = {"log": {"progress_bar": False, "rank_files": True}}


def test_a_nan_loss_on_one_rank_is_skipped_by_every_rank_and_named(tmp_path):
    # loss + NaN keeps the gradients finite: only the loss tells, and only on rank 1.
    fault = {"HEALTH_NAN_RANK": "1", "HEALTH_NAN_STEPS": "3,5", "HEALTH_NAN_HOW": "add"}
    sections = {**LOGGED, "train": {"epochs": 1, "log_every": 4}, "checkpoint": {"every_steps": 2, "keep_last": 2}}
    results = run_in_pool(_fit, world_size=2, args=(tmp_path, fault, sections), timeout=120)
    assert [r["error"] for r in results] == [None, None]
    # train_loss: nan, as it was
    assert repr(results[0]["metrics"]) == repr(results[1]["metrics"]) and results[0]["metrics"]["step"] == 8
    for name, value in results[0]["weights"].items():
        assert torch.equal(value, results[1]["weights"][name]) and torch.isfinite(value).all(), name
    log = _log(tmp_path)
    assert "step 3: non-finite loss on rank(s) 1; rank 1's batch had samples [" in log
    assert "step 5: non-finite loss on rank(s) 1" in log and "step 4:" not in log
    records = _records(tmp_path)
    assert records[-1]["skipped_steps"] == 2 and records[-1]["nonfinite_steps"] == 2
    assert all(r["grad_norm"] > 0 for r in records)
    assert _all_finite_on_disk(tmp_path)


def test_nan_gradients_with_accumulation_at_three_ranks(tmp_path):
    fault = {"HEALTH_NAN_RANK": "2", "HEALTH_NAN_STEPS": "2", "HEALTH_NAN_HOW": "mul"}
    sections = {**LOGGED, "train": {"epochs": 1, "log_every": 2, "grad_accum_steps": 2}, "data": {"batch_size": 8}}
    results = run_in_pool(_fit, world_size=3, args=(tmp_path, fault, sections), timeout=150)
    assert [r["error"] for r in results] == [None] * 3
    assert "step 2: non-finite loss on rank(s) 2; rank 2's batch had samples [" in _log(tmp_path)
    assert _records(tmp_path)[-1]["skipped_steps"] == 1
    assert all(torch.isfinite(v).all() for v in results[0]["weights"].values())


def _bucket_norms(view: bool) -> tuple[bool, float, float]:
    """On one rank: whether gradient_norm found DDP's flat buckets, its norm, and torch's own."""
    from torch.nn.parallel import DistributedDataParallel

    from ddpkit.distributed.gradient_norm import _bucket_buffers, gradient_norm

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.ReLU(), torch.nn.Linear(30, 5))
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=view, bucket_cap_mb=0.001)  # several buckets
    seen = []
    for _ in range(3):  # DDP rebuilds its buckets after the first step
        model.zero_grad(set_to_none=True)
        ddp(torch.randn(8, 20) * (torch.distributed.get_rank() + 1)).square().sum().backward()
        seen.append([p.grad for p in model.parameters()])
        gradient_norm(list(model.parameters()))
    grads = seen[-1]
    # With bucket views DDP hands out the very same view objects every step: what lets gradient_norm remember the
    # tiling.
    same = all(a is b for a, b in zip(seen[1], seen[2]))
    return (
        _bucket_buffers(grads) is not None,
        float(gradient_norm(list(model.parameters()))),
        float(torch.nn.utils.get_total_norm(grads)),
        same,
    )


def test_bucket_buffers_only_for_float_buffers_the_gradients_tile_exactly(monkeypatch):
    from ddpkit.distributed import gradient_norm as sharding
    from ddpkit.distributed.gradient_norm import _bucket_buffers

    def views(flat: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [flat[start : start + n].view(n) for start, n in zip(starts, sizes)]

    flat = torch.arange(10, dtype=torch.float32)
    assert [b.data_ptr() for b in _bucket_buffers(views(flat, [4, 6]))] == [flat.data_ptr()]
    assert _bucket_buffers(views(flat, [4, 5])) is None  # one element of the buffer is no gradient's
    assert _bucket_buffers([*views(flat, [4, 6]), torch.ones(3)]) is None  # one gradient is no view
    assert _bucket_buffers(views(flat.half(), [4, 6])) is None  # fp16: squares would overflow early
    # Remembered for the same gradient objects, checked again for any other set.
    derived = []
    real = sharding._tiled_buffers
    monkeypatch.setattr(sharding, "_tiled_buffers", lambda grads: derived.append(len(grads)) or real(grads))
    grads = views(flat, [4, 6])
    assert _bucket_buffers(grads)[0] is _bucket_buffers(list(grads))[0] is flat and derived == [2]
    assert _bucket_buffers([grads[0], torch.ones(6)]) is None and derived == [2, 2]
    assert (
        _bucket_buffers(views(flat, [4, 5])) is None and _bucket_buffers(grads) is not None and derived == [2, 2, 2, 2]
    )
    # Remembered weakly: once the run's gradients and buckets are gone, nothing here keeps them.
    import gc
    import weakref

    bucket = weakref.ref(flat)
    del flat, grads
    gc.collect()
    assert bucket() is None


def test_gradient_norm_reads_ddp_buckets_when_gradients_are_views_of_them():
    for view in (True, False):
        results = run_in_pool(_bucket_norms, world_size=2, args=(view,), timeout=120)
        assert [found for found, _, _, _ in results] == [view, view]
        assert [same for _, _, _, same in results] == [view, view]  # without views, new gradient tensors every step
        assert results[0][1] == results[1][1]  # the same buckets, the same bits: every rank decides alike
        assert results[0][1] == pytest.approx(results[0][2], rel=1e-6)


def test_nan_gradients_from_a_finite_loss_are_caught_in_the_gradient_norm(tmp_path):
    # Only the gradients tell: the norm, read from DDP's flat buckets (ddp.gradient_as_bucket_view, the
    # default) after the all-reduce, is NaN on every rank; the per-parameter path says the same.
    fault = {"HEALTH_NAN_RANK": "1", "HEALTH_NAN_STEPS": "2", "HEALTH_NAN_HOW": "grad"}
    runs = [
        (
            tmp_path / view,
            fault,
            {**LOGGED, "train": {"epochs": 1, "log_every": 2}, "ddp": {"gradient_as_bucket_view": view == "view"}},
        )
        for view in ("view", "copy")
    ]
    results = run_in_pool(_fit_each, world_size=2, args=(runs,), timeout=150)
    for i, (tmp, _, _) in enumerate(runs):
        assert [r[i]["error"] for r in results] == [None, None]
        assert "step 2: non-finite gradients after the all-reduce (the loss was finite on every rank)" in _log(tmp)
        records = _records(tmp)
        assert records[-1]["skipped_steps"] == 1 and records[-1]["nonfinite_steps"] == 1
        assert all(torch.isfinite(v).all() for v in results[0][i]["weights"].values())
    # Either way the same logged norms, to float32 rounding, and the same final weights.
    norms = [[r["grad_norm"] for r in _records(tmp)] for tmp, _, _ in runs]
    assert norms[0] == pytest.approx(norms[1], rel=1e-5)
    for name, value in results[0][0]["weights"].items():
        assert torch.equal(value, results[0][1]["weights"][name]), name


@pytest.mark.slow  # two runs in one spawn: about 20 s on the loaded 2-core machine
def test_stop_and_max_skips_end_the_run_on_every_rank_before_a_bad_update(tmp_path):
    fault = {"HEALTH_NAN_RANK": "0", "HEALTH_NAN_STEPS": "2,3,4,5", "HEALTH_NAN_HOW": "add"}
    stop = {**LOGGED, "health": {"nonfinite": "stop"}, "checkpoint": {"every_steps": 1}}
    results = run_in_pool(_fit, world_size=2, args=(tmp_path / "stop", fault, stop), timeout=120)
    assert all(
        "step 2: non-finite loss on rank(s) 0" in r["error"] and "health.nonfinite=stop" in r["error"] for r in results
    )
    assert _all_finite_on_disk(tmp_path / "stop")
    skips = {**LOGGED, "health": {"max_skips": 3}}
    results = run_in_pool(_fit, world_size=2, args=(tmp_path / "skips", fault, skips), timeout=120)
    assert all(
        "step 4:" in r["error"] and "3 skipped steps in a row (health.max_skips=3)" in r["error"] for r in results
    )


def test_a_loss_spike_is_skipped_or_rolled_back_at_the_same_step_on_every_rank(tmp_path):
    fault = {"HEALTH_SPIKE_STEPS": "20"}
    skip = {
        **LOGGED,
        "train": {"epochs": 3, "log_every": 4},
        "health": {"spike": {"warmup": 10, "window": 16, "action": "skip"}},
    }
    rollback = {
        **skip,
        "health": {"spike": {"warmup": 10, "window": 16, "action": "rollback"}},
        "checkpoint": {"every_steps": 6},
    }
    runs = [(tmp_path / "skip", fault, skip), (tmp_path / "rollback", fault, rollback)]
    skipped = run_in_pool(_fit_each, world_size=2, args=(runs,), timeout=150)[0][0]  # rank 0's first fit
    assert "step 20: spike: loss" in _log(tmp_path / "skip")
    last = _records(tmp_path / "skip")[-1]
    assert last["spikes"] >= 1 and last["skipped_steps"] == last["spikes"] and skipped["metrics"]["step"] == 24
    # steps 21-24 after a dropped update: back to normal (applied, it would be in the thousands)
    assert last["train_loss"] < 10
    log = _log(tmp_path / "rollback")
    assert "step 20: spike: loss" in log and "rolled back to the newest valid checkpoint" in log
    assert _records(tmp_path / "rollback")[-1]["rollbacks"] == 1


def test_non_finite_weights_are_never_written_and_no_good_checkpoint_is_pruned(tmp_path):
    fault = {"HEALTH_PERTURB_RANK": "1", "HEALTH_PERTURB_STEP": "3", "HEALTH_PERTURB_NAN": "1"}
    sections = {**LOGGED, "checkpoint": {"every_steps": 1, "keep_last": 2}}
    results = run_in_pool(_fit, world_size=2, args=(tmp_path, fault, sections), timeout=120)
    assert all("not writing the checkpoint of step 3" in r["error"] for r in results)  # rank 1's NaN stops both
    assert sorted(c.step for c in list_checkpoints(tmp_path / "run" / "checkpoints")) == [1, 2] and _all_finite_on_disk(
        tmp_path
    )


@pytest.mark.slow  # two runs in one spawn: about 20 s on the loaded 2-core machine
def test_a_slowed_rank_is_named_and_a_balanced_run_is_silent(tmp_path):
    straggler = {**LOGGED, "train": {"epochs": 3, "log_every": 8}, "health": {"straggler": {"every": 6, "windows": 2}}}
    run_in_pool(
        _fit,
        world_size=2,
        args=(tmp_path / "slow", {"HEALTH_SLOW_RANK": "1", "HEALTH_SLOW_MS": "15"}, straggler),
        timeout=120,
    )
    log = _log(tmp_path / "slow")
    assert "straggler: rank 1 is" in log and "straggler: rank 0" not in log
    assert _records(tmp_path / "slow")[-1]["straggler_rank"] == 1
    run_in_pool(_fit, world_size=2, args=(tmp_path / "even", {}, straggler), timeout=120)
    assert "straggler" not in _log(tmp_path / "even")


def test_a_perturbed_replica_is_caught_at_the_next_check(tmp_path):
    fault = {"HEALTH_PERTURB_RANK": "1", "HEALTH_PERTURB_STEP": "3"}
    broadcast = {**LOGGED, "train": {"epochs": 1}, "health": {"check_replicas_every": 4}}
    results = run_in_pool(_fit, world_size=2, args=(tmp_path / "b", fault, broadcast), timeout=120)
    assert "replica divergence at step 4: the parameters of rank(s) 1 differ from rank 0's" in _log(tmp_path / "b")
    for name, value in results[0]["weights"].items():
        assert torch.equal(value, results[1]["weights"][name]), name  # rank 0's weights were broadcast
    stop = {**broadcast, "health": {"check_replicas_every": 4, "on_divergence": "stop"}}
    results = run_in_pool(_fit, world_size=2, args=(tmp_path / "s", fault, stop), timeout=120)
    assert all("replica divergence at step 4" in r["error"] for r in results)


@pytest.mark.slow
@pytest.mark.parametrize("action, code", [("skip", 0), ("stop", 4)])  # 4: unhealthy, a retry will not fix it
def test_ddpkit_run_exit_codes(tmp_path, action, code):
    """The exit code of the whole `ddpkit run` command (0 for skip, 4 for stop) is what this checks."""
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(tiny_config(tmp_path, train={"epochs": 1}, checkpoint={"every_steps": 2})))
    env = {"HEALTH_NAN_RANK": "1", "HEALTH_NAN_STEPS": "3"}
    done = run_cli(
        "run", str(config), "--nproc-per-node", "2", "--script", str(SCRIPT), f"health.nonfinite={action}", env=env
    )
    assert done.returncode == code, done.stderr[-3000:]
    assert "step 3: non-finite loss on rank(s) 1" in done.stderr
    assert _all_finite_on_disk(tmp_path)
