"""GPU paths on a real GPU: NCCL, CUDA placement and RNG, bf16/fp16, compile, sharded modes.

    pytest -q tests/test_gpu.py          # on a machine with a CUDA GPU; skipped everywhere else (CI has none)

Each case is a real ``ddpkit run`` of one process on ``cuda:0`` (NCCL), checked from outside:
the exit code, the startup line, and the weights on disk. Resume cases compare a run that stops
after the first epoch and is resumed for the second with one that trains both epochs straight:
the MNIST CNN has dropout, so the second epoch's masks come from the restored CUDA RNG, and fp16's
GradScaler state must come back too.
"""

from __future__ import annotations

import pytest
import torch
import yaml
from helpers import (
    REPO,
    assert_bitwise_equal,
    load_weights,
    merge_sections,
    run_cli,
    tiny_cnn_config,
    tiny_config,
)

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"), pytest.mark.multiprocess]


def _cnn(tmp, **sections) -> dict:
    cfg = tiny_cnn_config(tmp, dist={"device": "cuda", "timeout": 120}, checkpoint={"every_epochs": 1})
    return merge_sections(cfg, sections)


def _run(tmp, cfg: dict, *extra: str):
    path = tmp / f"config-{len(list(tmp.glob('config-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    done = run_cli("run", str(path), "--nproc-per-node", "1", *extra, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def test_one_gpu_run_uses_nccl_on_cuda_and_writes_finite_weights(tmp_path):
    """NCCL and CUDA exist only in a real launch on a GPU machine: `ddpkit run` as users call it."""
    done = _run(tmp_path, _cnn(tmp_path))
    assert "backend=nccl device=cuda:0" in done.stderr
    weights = load_weights(tmp_path / "run" / "model.pt")
    assert all(t.device.type == "cpu" and torch.isfinite(t).all() for t in weights.values())


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_resume_on_cuda_is_bitwise_equal_to_a_straight_run(tmp_path, precision):
    """Three real launches on the GPU (straight, cut, resumed): cuDNN's and cuBLAS's determinism only shows there."""
    # train.deterministic: without it cuDNN's convolution backward is not bitwise reproducible at all
    # (an fp32 run resumed here once ended 6e-8 away from the straight one).
    train = {"precision": precision, "deterministic": True}
    _resumed_equals_straight(
        tmp_path, _cnn, train, first={"epochs": 1}, whole={"epochs": 2}, checkpoint={"every_epochs": 1}
    )


def _resumed_equals_straight(tmp, build, train: dict, *, first: dict, whole: dict, checkpoint: dict):
    """Train ``whole`` straight, and ``first`` then ``whole`` resumed; require bitwise-equal ``model.pt``;
    return the straight run's directory. ``build(out, **sections)`` makes a config (``_cnn``, ``_lm``)."""
    straight, resumed = tmp / "straight", tmp / "resumed"
    for out in (straight, resumed):
        out.mkdir()
    _run(straight, build(straight, train={**train, **whole}))
    _run(resumed, build(resumed, train={**train, **first}))
    _run(resumed, build(resumed, train={**train, **whole}, checkpoint={**checkpoint, "resume": "auto"}))
    assert_bitwise_equal(load_weights(resumed / "run" / "model.pt"), load_weights(straight / "run" / "model.pt"))
    return straight


def test_compile_on_cuda(tmp_path):
    """Inductor's CUDA kernels, compiled in a real launch (the CPU path compiles C++ instead)."""
    _run(tmp_path, _cnn(tmp_path, train={"epochs": 1, "compile": True, "precision": "bf16"}))
    assert all(torch.isfinite(t).all() for t in load_weights(tmp_path / "run" / "model.pt").values())


@pytest.mark.parametrize("mode", ["zero1", "fsdp2"])
def test_sharded_modes_on_nccl_save_and_resume(tmp_path, mode):
    """zero1 and fsdp2 over NCCL, saved and resumed by two real launches: the collectives Gloo does not exercise."""
    _run(tmp_path, _cnn(tmp_path, train={"epochs": 1}, parallel={"mode": mode}))
    _run(
        tmp_path,
        _cnn(tmp_path, train={"epochs": 2}, parallel={"mode": mode}, checkpoint={"every_epochs": 1, "resume": "auto"}),
    )
    assert all(torch.isfinite(t).all() for t in load_weights(tmp_path / "run" / "model.pt").values())


def test_gradient_norm_reads_bucket_views_on_cuda():
    from ddpkit.distributed.gradient_norm import _bucket_buffers, gradient_norm

    params = [torch.nn.Parameter(torch.zeros(n, device="cuda")) for n in (3, 1000, 7)]
    flat = torch.randn(sum(p.numel() for p in params), device="cuda")
    start = 0
    for p in params:
        p.grad = flat[start : start + p.numel()].view_as(p)
        start += p.numel()
    assert _bucket_buffers([p.grad for p in params]) is not None
    assert gradient_norm(params).item() == pytest.approx(
        torch.nn.utils.get_total_norm([p.grad for p in params]).item(), rel=1e-5
    )
    flat[500] = float("nan")
    assert not torch.isfinite(gradient_norm(params))


@pytest.mark.parametrize("action, code", [("skip", 0), ("stop", 4)])  # 4: ddpkit.errors.EXIT_UNHEALTHY
@pytest.mark.parametrize("how", ["mul", "grad"])
def test_nan_on_cuda_is_skipped_or_stops_without_a_host_sync_guard(tmp_path, action, code, how):
    """The CUDA guard without a host sync, and the exit code a launch returns: only a real GPU launch shows both."""
    # On CUDA the loss guard is loss * (loss * 0 + 1) (no host read) and the gradient norm is read
    # once before the update: a NaN loss (`mul`) and a NaN made only by backward (`grad`) are both caught.
    cfg = _cnn(tmp_path, train={"epochs": 1}, checkpoint={"every_steps": 2}, health={"nonfinite": action})
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {"HEALTH_NAN_RANK": "0", "HEALTH_NAN_STEPS": "3", "HEALTH_NAN_HOW": how}
    done = run_cli(
        "run",
        str(path),
        "--nproc-per-node",
        "1",
        "--script",
        str(REPO / "tests" / "scripts" / "health_trainer.py"),
        env=env,
        timeout=300,
    )
    assert done.returncode == code, done.stderr[-4000:]
    assert "step 3: non-finite" in done.stderr
    files = [tmp_path / "run" / "model.pt", *(tmp_path / "run" / "checkpoints").glob("*.pt")]
    weights = [load_weights(f) for f in files if f.exists()]
    assert weights and all(
        torch.isfinite(t).all() for w in weights for t in w.get("model", w).values() if torch.is_tensor(t)
    )


def _lm(tmp, **sections) -> dict:
    """A small gpt on a token file written here (random ids, vocab 97): the language-model path on CUDA."""
    import numpy as np

    for name, count in (("train", 40_000), ("val", 4_000)):
        np.random.default_rng(len(name)).integers(0, 97, count, dtype=np.uint16).tofile(tmp / f"{name}.bin")
    cfg = tiny_config(
        tmp,
        model={"name": "gpt", "kwargs": {"vocab_size": 97, "dim": 64, "depth": 2, "heads": 2, "max_len": 64}},
        data={
            "name": "tokens",
            "batch_size": 8,
            "kwargs": {"path": str(tmp / "train.bin"), "val_path": str(tmp / "val.bin"), "seq_len": 64},
        },
        optim={"name": "adamw", "lr": 1e-3, "momentum": 0.0},
        dist={"device": "cuda", "timeout": 120},
        checkpoint={"every_steps": 20},
    )
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_language_model_on_cuda_resumes_bitwise_with_tokens_weighting(tmp_path, precision):
    """Token data, the gpt, loss_normalization=tokens and tokens_per_s / mfu on CUDA;
    a resume equal to a straight run."""
    import json

    train = {
        "precision": precision,
        "deterministic": True,
        "loss_normalization": "tokens",
        "log_every": 10,
        "eval_every": 20,
    }
    straight = _resumed_equals_straight(
        tmp_path, _lm, train, first={"max_steps": 20}, whole={"max_steps": 40}, checkpoint={"every_steps": 20}
    )
    records = [json.loads(line) for line in (straight / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["tokens_per_s"] > 0 for r in records if "train_loss" in r)
    assert any("val_ppl" in r for r in records)


def test_a_token_id_outside_the_vocabulary_is_named_on_cuda_not_a_device_assert(tmp_path):
    """A device-side assert kills the whole process's CUDA context: only a real launch shows what the user reads."""
    cfg = _lm(tmp_path, train={"max_steps": 5})
    cfg["model"]["kwargs"]["vocab_size"] = 50  # the file holds ids up to 96
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    done = run_cli("run", str(path), "--nproc-per-node", "1", timeout=300)
    assert done.returncode != 0
    assert "is outside the model's vocabulary [0, 50)" in done.stderr and "device-side assert" not in done.stderr


def test_async_save_stages_a_cuda_state_in_reused_pinned_buffers_as_it_was_at_the_save(tmp_path, monkeypatch):
    """``checkpoint.async``'s staging on CUDA: the copies are queued into pinned host buffers, the next training
    step is queued right behind them, and the file still holds the state of the save, bitwise; a second save
    reuses the same buffers."""
    from ddpkit.checkpoint import files
    from ddpkit.checkpoint.staging import to_cpu

    given, real = [], files.save_checkpoint
    monkeypatch.setattr(files, "save_checkpoint", lambda state, *a, **k: (given.append(state), real(state, *a, **k))[1])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 8)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = torch.randn(256, 4096, device="cuda")

    def train_step():  # in-place updates of the weights and of AdamW's moments, all on the current stream
        model(batch).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    def capture():
        return {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "cuda_rng": torch.cuda.get_rng_state(),
        }

    writer = files.AsyncCheckpointWriter()
    expected = []
    for step in (1, 2):
        train_step()
        expected.append(to_cpu(capture()))  # a synchronous copy: the state at the save
        writer.stage_and_submit(capture(), tmp_path, step=step)
        train_step()  # queued at once, behind the copies
    writer.wait()
    for step, state in zip((1, 2), expected):
        _assert_same_bits(files.load_checkpoint(tmp_path / f"step-{step:09d}.pt"), state)
    weights = [given[i]["model"]["0.weight"] for i in (0, 1)]
    assert weights[0].is_pinned() and weights[0].data_ptr() == weights[1].data_ptr()
    assert all(given[0]["optimizer"]["state"][0][k].is_pinned() for k in ("exp_avg", "exp_avg_sq"))


def _assert_same_bits(got, want, where: str = "state") -> None:
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), f"{where} differs"
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for key in want:
            _assert_same_bits(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same_bits(g, w, f"{where}[{i}]")
    else:
        assert got == want, where


def test_a_dataset_already_on_the_gpu_is_gathered_there_with_the_default_pin_memory(tmp_path):
    """A TensorDataset kept on the GPU (benchmarks.gpu_bound's data path): ``data.pin_memory`` (on by default)
    is not applied to CUDA tensors, which cannot be pinned, and every batch reaches the step already on the GPU."""
    from torch.utils.data import TensorDataset

    from ddpkit import Trainer

    generator = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(64, 8, device="cuda", generator=generator)
    y = torch.randint(0, 2, (64,), device="cuda", generator=generator)

    class OnGpu(Trainer):
        devices: list[str] = []

        def build_model(self):
            return torch.nn.Linear(8, 2)

        def build_datasets(self):
            return TensorDataset(x, y), TensorDataset(x[:16], y[:16])

        def training_step(self, batch):
            self.devices.append(batch[0].device.type)
            return super().training_step(batch)

    cfg = tiny_config(
        tmp_path,
        data={"batch_size": 8, "pin_memory": True},
        dist={"device": "cuda"},
        train={"max_steps": 5, "epochs": None},
    )
    trainer = OnGpu(cfg)
    metrics = trainer.fit()
    assert OnGpu.devices == ["cuda"] * 5 and trainer.train_loader.pin_memory is False
    assert metrics["step"] == 5 and torch.isfinite(torch.tensor(metrics["val_loss"]))
