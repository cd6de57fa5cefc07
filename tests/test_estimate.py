"""``ddpkit estimate`` against the bytes each rank really holds after training steps in each mode.

.venv/bin/pytest tests/test_estimate.py -q
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import cpu_runtime, run_cli
from torch.nn import functional as F

from ddpkit.tools.estimate import estimate

pytestmark = pytest.mark.timeout(300)


def _config(tmp_path) -> dict:
    """A small GPT on a token file of 1,025 ids below 64 (64 windows of 16)."""
    (np.arange(1025) % 64).astype(np.uint16).tofile(tmp_path / "train.bin")
    return {
        "model": {"name": "gpt", "kwargs": {"vocab_size": 64, "dim": 36, "depth": 3, "heads": 3, "max_len": 16}},
        "data": {"name": "tokens", "batch_size": 4, "kwargs": {"path": str(tmp_path / "train.bin"), "seq_len": 16}},
        "optim": {"name": "adamw", "lr": 0.001},
        "train": {"epochs": 1},
    }


def _measured(config: dict) -> dict:
    """Each mode as the Trainer builds it, two AdamW steps, then a backward: the tensors this rank holds."""
    from ddpkit.config.loader import load_config
    from ddpkit.distributed.memory import rank_bytes
    from ddpkit.parallel.layout import data_parallel_for
    from ddpkit.registry import build_model
    from ddpkit.training.optim import build_optimizer

    runtime = cpu_runtime()
    out = {}
    for mode in ("ddp", "zero1", "fsdp2"):
        cfg = load_config({**config, "parallel": {"mode": mode}})
        way = data_parallel_for(cfg.parallel)
        model = way.shard(build_model(cfg.model), mesh=None, runtime=runtime)
        optimizer = way.shard_optimizer(build_optimizer(model.parameters(), cfg.optim))
        wrapped = way.wrap(model, runtime, cfg.ddp)
        x = torch.randint(0, 64, (4, 16))
        for _ in range(3):
            optimizer.zero_grad()
            F.cross_entropy(wrapped(x).flatten(0, 1), torch.roll(x, -1, 1).flatten()).backward()
            if _ < 2:
                optimizer.step()
        out[mode] = rank_bytes(model, optimizer)  # real gradients and optimizer state exist now
    return out


@pytest.mark.slow  # about 40 s on the loaded 2-core machine
def test_estimate_is_within_ten_percent_of_the_bytes_each_rank_holds(tmp_path):
    from helpers import run_in_pool

    config = _config(tmp_path)
    measured = run_in_pool(_measured, 2, args=(config,), timeout=200)
    predicted = estimate(config, nproc=2)
    for mode, bytes_ in predicted.per_mode.items():
        for part in ("parameters", "gradients", "optimizer"):
            real = max(getattr(rank[mode], part) for rank in measured)
            assert abs(getattr(bytes_, part) - real) <= 0.10 * real, (mode, part, getattr(bytes_, part), real)
    assert predicted.per_mode["fsdp2"].parameters < 0.6 * predicted.per_mode["ddp"].parameters
    assert predicted.activations and predicted.activations > 0


@pytest.mark.slow
def test_the_command_prints_every_mode_and_a_recommendation(tmp_path):
    import yaml

    (tmp_path / "lm.yaml").write_text(yaml.safe_dump(_config(tmp_path)))
    result = run_cli(
        "estimate", str(tmp_path / "lm.yaml"), "--nproc-per-node", "3", "--memory-per-rank", "0.00015", timeout=120
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines[3:6]] == ["ddp", "zero1", "fsdp2"]
    assert lines[-1].startswith("recommendation: fsdp2") or lines[-1].startswith("recommendation: none fits")
    bad = run_cli("estimate", str(tmp_path / "lm.yaml"), "--nproc-per-node", "2", "optim.lr=-1", timeout=120)
    assert bad.returncode == 2 and "optim.lr" in bad.stderr


def test_under_a_pipeline_the_estimate_is_the_largest_stages_rank():
    from ddpkit.tools.estimate import estimate

    gpt = {"name": "gpt", "kwargs": {"vocab_size": 257, "dim": 64, "depth": 8, "heads": 4, "max_len": 64}}
    whole = estimate({"model": gpt}, nproc=2)
    piped = estimate({"model": gpt, "parallel": {"pipeline": 2}}, nproc=4)
    # fsdp2 inside a pipeline shards each stage over its 2 replicas (rank 0's dim-0 chunks are rounded up)
    assert list(piped.per_mode) == ["ddp", "zero1", "fsdp2"]
    half = piped.per_mode["ddp"].parameters / 2
    assert half <= piped.per_mode["fsdp2"].parameters < 1.01 * half
    # Half the blocks and the embeddings or the head: more than a third, less than all of the parameters.
    assert whole.count / 3 < piped.stage_count < whole.count
    assert piped.per_mode["ddp"].parameters == piped.stage_count * 4
