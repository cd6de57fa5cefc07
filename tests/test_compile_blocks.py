"""``train.compile`` block by block under fsdp2 and inside pipeline stages, against a world of one.

    .venv/bin/pytest -q tests/test_compile_blocks.py            # -m slow for the runs on 2 ranks

Dynamo's ``aot_eager`` backend (no C++ compiler): the graphs and the autograd are the compiled ones, the kernels
eager ones, so the arithmetic is a world of one's up to the order of its sums.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import RaggedSequences, full_state, run_in_pool
from torch import nn

import ddpkit
from ddpkit.models.gpt import gpt
from ddpkit.parallel.block_compile import compile_blocks
from ddpkit.parallel.model_views import CompileWatch, compile_settings

pytestmark = pytest.mark.timeout(400)

GPT = {"vocab_size": 50, "dim": 32, "depth": 4, "heads": 2, "max_len": 16}


def test_each_block_is_compiled_in_place_keeping_every_name_and_the_logits():
    torch.manual_seed(0)
    model = gpt(**GPT)
    names = list(model.state_dict())
    x = torch.randint(0, 50, (2, 16))
    with torch.no_grad():
        eager = model(x)
    settings = compile_settings({"backend": "eager"})
    torch._dynamo.reset()
    watch = CompileWatch(settings.recompile_limit)
    try:
        assert compile_blocks(model, settings) == 4
        # The root's forward is its own: FSDP2's root hooks and the pipeline stage's call stay outside.
        assert "forward" not in vars(model) and all("forward" in vars(block) for block in model.blocks)
        assert list(model.state_dict()) == names
        with torch.no_grad():
            assert torch.equal(model(x), eager)
        # The four identical blocks share one graph.
        assert watch.compilations == 1 and not watch.recompiles
        # A part with no container of blocks (a user's model cut by module names) is compiled whole, in place.
        lone = nn.Linear(4, 4)
        assert compile_blocks(lone, settings) == 1
        lone(torch.ones(1, 4))
        assert watch.compilations == 2
    finally:
        watch.close()


def test_compile_is_accepted_with_fsdp2_and_with_a_pipeline():
    from ddpkit.config.loader import load_config

    for parallel in ({"mode": "fsdp2"}, {"pipeline": 2}, {"pipeline": 2, "mode": "fsdp2"}):
        cfg = load_config({"train": {"max_steps": 1, "compile": True}, "parallel": parallel})
        assert cfg.train.compile is True


class TiedGpt(ddpkit.Trainer):
    """ddpkit's tied GPT on ragged sequences, validated on 21 more."""

    def build_datasets(self):
        return RaggedSequences(n=64), RaggedSequences(n=21)

    def on_fit_start(self):
        # Kept: the run's end closes the watch and lets go of it.
        self.watch = self.placed.models.watch


def _config(out: Path, *, parallel: dict | None, compile_: bool) -> dict:
    """Global batch 8 in 4 microbatches (a pipeline's, or the accumulation's), SGD with momentum."""
    cfg = {
        "run": {"name": "gpt", "output_dir": str(out), "seed": 3},
        "data": {"global_batch_size": 8, "order": "index_free", "val_batch_size": 3},
        "model": {"name": "gpt", "kwargs": GPT},
        "optim": {"name": "sgd", "lr": 0.5, "momentum": 0.9},
        "train": {"max_steps": 3, "log_every": 3, "eval_every": 3},
        "checkpoint": {"every_epochs": None},
        "log": {"progress_bar": False},
    }
    if compile_:
        cfg["train"]["compile"] = {"backend": "aot_eager"}
    if parallel is None:
        cfg["train"]["grad_accum_steps"] = 4
    else:
        cfg["parallel"] = parallel
    return cfg


def _fit(cfg: dict) -> dict:
    trainer = TiedGpt(cfg)
    metrics = trainer.fit()
    watch = trainer.watch
    compiled = None if watch is None else {"compilations": watch.compilations, "recompiles": list(watch.recompiles)}
    return {"metrics": metrics, "state": full_state(trainer.placed.held, trainer.optimizer), "compiled": compiled}


LAYOUTS = {
    "fsdp2": {"mode": "fsdp2"},
    "pp2-ddp": {"pipeline": 2, "microbatches": 4},
    "pp2-fsdp2": {"pipeline": 2, "microbatches": 4, "mode": "fsdp2"},
}


def _compiled_layouts(tmp: Path) -> dict:
    out = {}
    for name, parallel in LAYOUTS.items():
        # Dynamo's cache is the process's: each layout compiles from nothing, so its watch sees its compilations.
        torch._dynamo.reset()
        cfg = _config(tmp / name, parallel=parallel, compile_=True)
        if name == "fsdp2":
            # fsdp2 on 2 ranks accumulates 2 microbatches of 2 a rank: the world of one's 4.
            cfg["train"]["grad_accum_steps"] = 2
        out[name] = _fit(cfg)
    return out


def _relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-12)) for k in b)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_compiled_blocks_under_fsdp2_and_in_pipeline_stages_train_and_validate_like_a_world_of_one(tmp_path):
    one = run_in_pool(_fit, 1, args=(_config(tmp_path / "one", parallel=None, compile_=False),), timeout=120)[0]
    ranks = run_in_pool(_compiled_layouts, 2, args=(tmp_path,), timeout=360)
    for name in LAYOUTS:
        results = [rank[name] for rank in ranks]
        state: dict[str, torch.Tensor] = {}
        for result in results:
            state.update(result["state"])
        assert set(state) == set(one["state"]), name
        assert _relative(state, one["state"]) < 1e-6, name
        for metric in ("train_loss", "val_loss"):
            last = results[-1]["metrics"][metric]
            assert last == pytest.approx(one["metrics"][metric], rel=1e-6), (name, metric)
        for result in results:
            # The blocks are compiled (the watch saw it), and identical blocks share their graphs: a training and a
            # validation version, not one per block.
            assert result["compiled"]["compilations"] >= 1, name
            assert len(result["compiled"]["recompiles"]) <= 2, (name, result["compiled"])
