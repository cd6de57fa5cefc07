"""The pairs of options a torchtitan user tries on day one, each trained on Gloo ranks against a world of one.

    .venv/bin/pytest -q tests/test_combinations.py            # -m slow: the compiled pairs

docs/modes.md's "Every combination" table says, for every pair of options, whether it is tested, and by which test,
or refused and why. These are the pairs that no other test ran: a pipeline with ZeRO-1, activation checkpointing
(AC) or bf16; tensor parallelism with the document mask or bf16; HSDP with compile, LoRA, the document mask, AC or
bf16; ZeRO-1 and FSDP2 with the document mask or bf16; LoRA, the document mask, AC and bf16 with each other;
fsdp2 with its vocabulary split (``parallel.fsdp.shard_vocabulary``) with the document mask, AC, bf16, LoRA or
compile; and three that other tests ran only in part (DDP with the document mask, alone and with AC, and compiled).
Each is the real Trainer's run of a tiny Llama (2 blocks, dim 32, grouped-query attention, an untied head) on a
token file the test writes, 3 SGD steps with momentum, the token-weighted loss: the pair on 2 ranks (4 for HSDP
and for a pipeline with ZeRO-1 beside it), and the same options but the layout in a world of one.

The world of one accumulates micro-batches of the size each data-parallel rank runs (2 samples; 1 under HSDP's 4
ranks), so each micro-batch's gradient is the same arithmetic in both runs and only the order its sums are added
in differs. What is compared, on every rank: every parameter and momentum buffer (gathered whole: fsdp2's shards,
a stage's part, ZeRO-1's optimizer entries) and the training loss, within the issue's limits:

- **bitwise** where the arithmetic is the same: a pipeline of an untied model runs each microbatch's forward and
  backward as the world of one's accumulation does, in the same order;
- **1e-6 relative** (of each tensor's largest entry) where the data-parallel ranks add gradients in another order;
- **1e-5** under tensor parallelism (each rank's half of a product, summed);
- **a few bf16 units** (``BF16``) for the other bf16 runs: held to a world of one in bf16 (fp32 would measure bf16's
  own rounding, 1e-2 apart, not the layout's), where an fp32 weight's last bits, added in another order, can round
  it to the other bf16 neighbour, and tensor parallelism rounds each rank's half of a product before the sum.

FSDP2's bf16 is its ``MixedPrecisionPolicy``: parameters cast to bf16, so norms and the residual stream run in bf16
too, where ``torch.autocast`` keeps them in fp32; its reference is fsdp2 in a world of one, the same arithmetic.

That each option is on is checked beside the numbers, from what ran: under bf16 every ``nn.Linear`` returned bf16;
under AC each block's ``nn.Linear`` ran twice a micro-batch (the recompute); under the document mask the model
holds the documents' setting; under LoRA the model's state is the adapter alone; under compile the watch counted
compilations. And the table itself is checked: every test it names exists, every pair here is named there.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import REPO, full_state, run_in_pool
from torch import nn

import ddpkit

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

LLAMA = {"arch": "llama", "vocab_size": 50, "dim": 32, "depth": 2, "heads": 4, "kv_heads": 2, "mlp_dim": 64}
#: The end-of-text id in the token file: about one token in eight, so each 16-token window holds a few documents.
EOT = 7
STEPS = 3
#: Micro-batches each rank runs a step (accumulation, or a pipeline's microbatches).
MICRO = 2
HSDP = {"mode": "fsdp2", "replicate": 2}
#: fsdp2 with the embedding and the head split by vocabulary rows over the ranks, outside FSDP2's units.
VOCAB_SPLIT = {"mode": "fsdp2", "fsdp": {"shard_vocabulary": True}}
#: bf16 keeps 8 significant bits (neighbours 2^-8 = 3.9e-3 apart). Data-parallel ranks add gradients in another
#: order than the world of one: fp32 weights 1e-7 apart, which now and then round to different bf16 neighbours,
#: and so does every product a weight enters. Measured at 3 steps over 9 seeds: at most 6e-8 under FSDP2's bf16 and
#: LoRA's (bf16 gradients, near-exact sums), 1e-7 mostly under autocast but 1.9e-4 (zero1, AC) and 1.1e-3 (the
#: document mask) on one seed. Under tensor parallelism each rank's half of a row-wise product is rounded to bf16
#: before the halves are added, where a world of one rounds the whole sum once: 7.0e-3 to 8.4e-3 (of a momentum
#: buffer's largest entry) on every seed. 2e-2 is five bf16 units; a gradient missing a rank's share, or counted
#: twice, is off by its whole size. That bf16 ran at all is checked apart (every Linear's output dtype).
BF16 = 2e-2

#: id -> (ranks, parallel section, options, bound: None for bitwise). Options: lora, mask (the document mask),
#: ac (activation checkpointing), bf16 (train.precision), compile (aot_eager).
PAIRS: dict[str, tuple[int, dict, dict, float | None]] = {
    "pp_x_ac": (2, {"pipeline": 2}, {"ac": True}, None),
    "pp_x_bf16": (2, {"pipeline": 2}, {"bf16": True}, None),
    "tp_x_mask": (2, {"tensor": 2}, {"mask": True}, 1e-5),
    "tp_x_bf16": (2, {"tensor": 2}, {"bf16": True}, BF16),
    "zero1_x_mask": (2, {"mode": "zero1"}, {"mask": True}, 1e-6),
    "fsdp2_x_mask": (2, {"mode": "fsdp2"}, {"mask": True}, 1e-6),
    "zero1_x_bf16": (2, {"mode": "zero1"}, {"bf16": True}, BF16),
    "fsdp2_x_bf16": (2, {"mode": "fsdp2"}, {"bf16": True}, BF16),
    "lora_x_mask": (2, {}, {"lora": True, "mask": True}, 1e-6),
    "lora_x_ac": (2, {}, {"lora": True, "ac": True}, 1e-6),
    "lora_x_bf16": (2, {}, {"lora": True, "bf16": True}, BF16),
    "ac_x_bf16": (2, {}, {"ac": True, "bf16": True}, BF16),
    "mask_x_bf16": (2, {}, {"mask": True, "bf16": True}, BF16),
    "pp_x_zero1": (4, {"pipeline": 2, "mode": "zero1"}, {}, 1e-6),
    "hsdp_x_lora": (4, HSDP, {"lora": True}, 1e-6),
    "hsdp_x_mask": (4, HSDP, {"mask": True}, 1e-6),
    "hsdp_x_ac": (4, HSDP, {"ac": True}, 1e-6),
    "hsdp_x_bf16": (4, HSDP, {"bf16": True}, BF16),
    "hsdp_x_compile": (4, HSDP, {"compile": True}, 1e-6),
    "compile_x_lora": (2, {}, {"compile": True, "lora": True}, 1e-6),
    # tested before only by a run's finite loss (configs/packed_tiny.yaml) or by the model's logits alone
    "ddp_x_mask": (2, {}, {"mask": True}, 1e-6),
    "mask_x_ac": (2, {}, {"mask": True, "ac": True}, 1e-6),
    "compile_x_mask": (2, {}, {"compile": True, "mask": True}, 1e-6),
    "vocab_split_x_mask": (2, VOCAB_SPLIT, {"mask": True}, 1e-6),
    "vocab_split_x_ac": (2, VOCAB_SPLIT, {"ac": True}, 1e-6),
    "vocab_split_x_bf16": (2, VOCAB_SPLIT, {"bf16": True}, BF16),
    "vocab_split_x_lora": (2, VOCAB_SPLIT, {"lora": True}, 1e-6),
    "vocab_split_x_compile": (2, VOCAB_SPLIT, {"compile": True}, 1e-6),
}
COMPILED = [name for name, (_, _, options, _) in PAIRS.items() if options.get("compile")]
EAGER = [name for name in PAIRS if name not in COMPILED]


def _token_file(path: Path) -> str:
    """4,096 token ids below 50, one in eight of them the end-of-text."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 50, 4096)
    ids[rng.random(4096) < 0.12] = EOT
    ids.astype(np.uint16).tofile(path)
    return str(path)


def _config(out: Path, data: str, *, parallel: dict, accumulate: int, options: dict) -> dict:
    """The tokens dataset in 16-token windows, global batch 8; ``accumulate`` micro-batches a step when there is no
    pipeline (a pipeline's microbatches are its accumulation)."""
    parallel = dict(parallel)
    train: dict[str, Any] = {"max_steps": STEPS, "log_every": STEPS, "loss_normalization": "tokens"}
    if parallel.get("pipeline", 1) > 1:
        parallel["microbatches"] = MICRO
    else:
        train["grad_accum_steps"] = accumulate
    train["activation_checkpointing"] = options.get("ac", False)
    train["precision"] = "bf16" if options.get("bf16") else "fp32"
    if options.get("compile"):
        train["compile"] = {"backend": "aot_eager"}
    model: dict[str, Any] = {"name": "gpt", "kwargs": {**LLAMA, "max_len": 16, "tied": False}}
    if options.get("lora"):
        model["lora"] = {"r": 4, "alpha": 8, "targets": "all-linear"}
    data_kwargs: dict[str, Any] = {"path": data, "seq_len": 16, "vocab_size": 50}
    if options.get("mask"):
        data_kwargs.update(document_mask=True, restart_positions=True, eot=EOT)
    return {
        "run": {"name": "combination", "output_dir": str(out), "seed": 3},
        "data": {"name": "tokens", "global_batch_size": 8, "order": "index_free", "kwargs": data_kwargs},
        "model": model,
        "optim": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
        "train": train,
        "parallel": parallel,
        "checkpoint": {"every_epochs": None, "every_steps": None},
        "log": {"progress_bar": False},
    }


def _configs(tmp: Path, name: str) -> tuple[int, dict, dict, float | None]:
    """The pair's ranks, its config, its world of one's config, and its bound."""
    ranks, parallel, options, bound = PAIRS[name]
    data = _token_file(tmp / "tokens.bin")
    replicas = ranks // (parallel.get("pipeline", 1) * parallel.get("tensor", 1))
    pair = _config(tmp / name, data, parallel=parallel, accumulate=MICRO, options=options)
    # fsdp2's bf16 casts its parameters (MixedPrecisionPolicy): the world of one runs it too, on its one rank
    alone = {"mode": "fsdp2"} if parallel.get("mode") == "fsdp2" and options.get("bf16") else {}
    # compile is checked against the eager world of one
    eager = {key: value for key, value in options.items() if key != "compile"}
    one = _config(tmp / "one", data, parallel=alone, accumulate=MICRO * replicas, options=eager)
    return ranks, pair, one, bound


class Probed(ddpkit.Trainer):
    """The Trainer, recording from its held model what ran: each ``nn.Linear``'s calls and output dtypes."""

    def on_fit_start(self) -> None:
        self.calls: dict[str, int] = {}
        self.dtypes: set[torch.dtype] = set()
        # Kept: the run's end closes the watch and lets go of it.
        self.watch = self.placed.models.watch
        if self.watch is not None:
            return  # a hook added after compile would change what was compiled
        for name, module in self.placed.held.named_modules():
            if isinstance(module, nn.Linear):
                module.register_forward_hook(self._record(name))

    def _record(self, name: str):
        def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            if torch.is_grad_enabled():
                self.calls[name] = self.calls.get(name, 0) + 1
                self.dtypes.add(output.dtype)

        return hook


def _fit(cfg: dict) -> dict:
    trainer = Probed(cfg)
    metrics = trainer.fit()
    held = trainer.placed.held
    documents = next((m.documents for m in held.modules() if getattr(m, "documents", None)), None)
    # the Linear layers inside the blocks (not the head, which no checkpoint recomputes), by how often each ran
    block_calls = {count for name, count in trainer.calls.items() if ".blocks." in f".{name}"}
    watch = trainer.watch
    return {
        "metrics": metrics,
        "state": full_state(held, trainer.optimizer),
        "dtypes": trainer.dtypes,
        "block_calls": block_calls,
        "documents": documents,
        "compilations": None if watch is None else watch.compilations,
    }


def _relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest difference of one tensor's elements, relative to that tensor's largest."""
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-12)) for k in b)


def _check_options_ran(result: dict, options: dict) -> None:
    """What the rank recorded shows that each of the pair's options was on (the module docstring's list)."""
    if options.get("compile"):
        assert result["compilations"] >= 1
    else:
        assert result["dtypes"] == {torch.bfloat16 if options.get("bf16") else torch.float32}
        # Each micro-batch's forward (and a pipeline's one more, its first step's shape inference); under AC also
        # its recompute in the backward, which stops at the last output the backward needs (torch's early stop):
        # a block's last Linear runs once a micro-batch, the others twice.
        twice = max(result["block_calls"]) >= 2 * STEPS * MICRO
        assert twice == bool(options.get("ac")), result["block_calls"]
    expected = {"eot": EOT, "restart_positions": True} if options.get("mask") else None
    assert result["documents"] == expected
    model_keys = [key for key in result["state"] if key.startswith("model.")]
    assert all(".lora_" in key for key in model_keys) == bool(options.get("lora"))


def _check_pair(tmp: Path, name: str) -> None:
    ranks, pair, one, bound = _configs(tmp, name)
    options = PAIRS[name][2]
    reference = run_in_pool(_fit, 1, args=(one,), timeout=120)[0]
    results = run_in_pool(_fit, ranks, args=(pair,), timeout=240)
    for rank, result in enumerate(results):
        _check_options_ran(result, options)
        assert result["metrics"]["step"] == STEPS
        state, expected = result["state"], reference["state"]
        assert state.keys() == expected.keys(), rank
        loss, expected_loss = result["metrics"]["train_loss"], reference["metrics"]["train_loss"]
        if bound is None:
            assert all(torch.equal(state[k], expected[k]) for k in expected), rank
            assert loss == expected_loss, rank
        else:
            assert _relative(state, expected) < bound, rank
            assert loss == pytest.approx(expected_loss, rel=bound), rank


@pytest.mark.parametrize("name", EAGER)
def test_each_pair_trains_like_a_world_of_one(tmp_path, name):
    _check_pair(tmp_path, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", COMPILED)
def test_each_compiled_pair_trains_like_an_eager_world_of_one(tmp_path, name):
    # Dynamo's cache is the rank's: each run compiles from nothing, so its watch sees its compilations.
    run_in_pool(torch._dynamo.reset, PAIRS[name][0])
    _check_pair(tmp_path, name)


def _combination_table() -> str:
    text = (REPO / "docs" / "modes.md").read_text()
    start = text.index("## Every combination")
    end = text.find("\n## ", start)
    return text[start : None if end < 0 else end]


def test_the_docs_table_names_a_test_that_exists_for_every_pair():
    """docs/modes.md's "Every combination" table stays true: each test it names is defined (with each of these
    pairs' ids), each pair here is named there, and no row is left untested."""
    table = _combination_table()
    defined = {
        name
        for path in (REPO / "tests").glob("test_*.py")
        for name in re.findall(r"^def (test_\w+)", path.read_text(), re.M)
    }
    named = re.findall(r"`(test_\w+)(?:\[(\w+)\])?`", table)
    assert named
    for test, pair in named:
        assert test in defined, test
        if pair:
            assert pair in PAIRS, f"{test}[{pair}]"
    ids = {pair for _, pair in named}
    assert set(PAIRS) <= ids, set(PAIRS) - ids
    assert "not refused, untested |" not in table
