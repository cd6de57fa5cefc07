"""Issue 67: ``model.kwargs.init_from`` on the meta build, each rank reading only the tensors and slices it holds.

    .venv/bin/pytest -q tests/test_init_from_slices.py

Tiny Hugging Face directories that transformers writes here (sharded, tied, bf16, GPT-2's Conv1D, a padded
vocabulary, grouped k/v heads) are loaded under pp2, tp2 and fsdp2 on 2 Gloo ranks: the weights, made whole, equal
a world of one's bit for bit, the logits equal transformers', each rank reads as many elements as it holds, and a
missing, truncated or misshapen file stops every rank with the file and the tensor named.
"""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import pytest
import torch
from helpers import RaggedSequences, run_in_pool
from hf_tiny import save_tiny, tokens

import ddpkit
from ddpkit.errors import CheckpointError
from ddpkit.models import hf_slices
from ddpkit.models.gpt import gpt

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytestmark = pytest.mark.timeout(200)

X = tokens(12, vocab=50)


def _config(out: Path, directory: Path, model: dict, parallel: dict) -> dict:
    """One step from ``directory``'s weights (a pipeline: its 2 microbatches)."""
    pipelined = parallel.get("pipeline", 1) > 1
    return {
        "run": {"name": "init-from", "output_dir": str(out), "seed": 3},
        "data": {"global_batch_size": 4},
        "model": {"name": "gpt", "kwargs": {"init_from": str(directory), "max_len": 16, **model}},
        "optim": {"name": "adamw", "lr": 1e-3},
        "train": {"max_steps": 1},
        "parallel": {**parallel, **({"microbatches": 2} if pipelined else {})},
        "checkpoint": {"every_epochs": None},
        "log": {"progress_bar": False},
    }


class FromDirectory(ddpkit.Trainer):
    """Keeps the weights it starts from, whole, the logits of X (without a pipeline) and what this rank holds."""

    def build_datasets(self):
        return RaggedSequences(n=8, vocab=50), None

    def on_fit_start(self) -> None:
        held = self.placed.held
        # a DTensor's full_tensor is a collective on its mesh: every rank of the layout runs it
        self.initial = {k: _whole(v).detach().clone() for k, v in held.state_dict().items()}
        self.held = sum(_local(p).numel() for p in held.parameters())
        self.logits = None
        if self.placed.pipeline is None:
            with torch.no_grad():
                self.logits = _whole(self.placed.models.eval(X)).clone()


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class _Recording:
    """A weight file as ``hf_slices`` opens it, counting the elements each slice read brings in."""

    def __init__(self, handle, reads: list[tuple[str, int]]):
        self.handle, self.reads = handle, reads

    def __enter__(self):
        self.handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)

    def keys(self):
        return self.handle.keys()

    def get_slice(self, name: str):
        inner, reads = self.handle.get_slice(name), self.reads

        class Slice:
            def get_shape(self):
                return inner.get_shape()

            def __getitem__(self, index):
                piece = inner[index]
                reads.append((name, piece.numel()))
                return piece

        return Slice()


def _run(cfg: dict) -> dict:
    """Rank r: the run's start, the elements read by name, and the meta build's log."""
    from ddpkit.parallel import meta_build

    reads: list[tuple[str, int]] = []
    lines: list[str] = []
    real = hf_slices._open
    recorder = mock.Mock()
    recorder.info = lambda message, *args: lines.append(message % args)
    with (
        mock.patch.object(hf_slices, "_open", lambda path, **kw: _Recording(real(path, **kw), reads)),
        mock.patch.object(meta_build, "log", recorder),
    ):
        trainer = FromDirectory(cfg)
        trainer.fit()
    return {"initial": trainer.initial, "logits": trainer.logits, "held": trainer.held, "reads": reads, "log": lines}


def _reference(directory: Path, model: dict) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """Transformers' model of ``directory`` in fp32, and ddpkit's whole CPU build of it (its state, bit for bit)."""
    theirs = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ours = gpt(init_from=str(directory), max_len=16, **model).eval()
    return theirs, ours


def _directory(tmp_path: Path, kind: str) -> tuple[Path, dict]:
    """A Hugging Face directory of ``kind`` and the extra model kwargs it runs with."""
    directory = tmp_path / kind
    if kind == "gpt2":
        torch.manual_seed(0)
        config = transformers.GPT2Config(vocab_size=101, n_positions=32, n_embd=24, n_layer=2, n_head=2)
        model = transformers.GPT2LMHeadModel(config)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn_like(param) * 0.05)
        model.save_pretrained(directory, max_shard_size="20KB")
        # padded: 101 ids to 128, the pad rows zeros
        return directory, {"vocab_size": 128}
    family, dtype = {"qwen2-pp": ("qwen2", None), "llama-bf16": ("llama", torch.bfloat16), "qwen3": ("qwen3", None)}[
        kind
    ]
    if dtype is None:
        save_tiny(directory, family)
    else:
        save_tiny(tmp_path / "fp32", family).to(dtype).save_pretrained(directory, max_shard_size="20KB")
    return directory, {}


#: (directory, layout): pp2 on a sharded untied Qwen2; tp2 on a tied Llama in bf16 with grouped k/v; fsdp2 on a
#: tied Qwen3 with one k/v head; fsdp2 on GPT-2 (transposed Conv1D, a padded vocabulary, a cropped position table);
#: on 4 ranks, fsdp2 x tp2 (FSDP2's shard of a tensor plan's shard) and pp2 x tp2.
CASES = [
    ("qwen2-pp", {"pipeline": 2}),
    ("llama-bf16", {"tensor": 2}),
    ("qwen3", {"mode": "fsdp2"}),
    ("gpt2", {"mode": "fsdp2"}),
    ("llama-bf16", {"mode": "fsdp2", "tensor": 2}),
    ("qwen2-pp", {"pipeline": 2, "tensor": 2}),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("kind", "parallel"), CASES, ids=[f"{kind}-{'-'.join(map(str, p.values()))}" for kind, p in CASES]
)
def test_init_from_reads_only_what_each_rank_holds_and_gives_transformers_logits(tmp_path, kind, parallel):
    directory, model = _directory(tmp_path, kind)
    files = sorted(p.name for p in directory.glob("*.safetensors"))
    assert len(files) > 1 and (directory / "model.safetensors.index.json").is_file()
    theirs, ours = _reference(directory, model)
    ranks = 4 if len(parallel) > 1 else 2
    results = run_in_pool(_run, ranks, args=(_config(tmp_path / "run", directory, model, parallel),), timeout=180)
    whole = ours.state_dict()
    total = sum(p.numel() for p in ours.parameters())
    merged: dict[str, torch.Tensor] = {}
    for result in results:
        assert "model: built on the meta device; each rank makes and initialises only what it holds" in result["log"]
        merged.update(result["initial"])
        read = sum(n for _, n in result["reads"])
        # only what this rank holds (a padded vocabulary's rows are zeros, not read)
        assert read == result["held"] if "vocab_size" not in model else read <= result["held"], (read, result["held"])
        assert read < total
    if "vocab_size" in model:
        # fsdp2: every element on one rank; the pad rows (27 of GPT-2's 24-wide embedding) read by none
        assert sum(n for result in results for _, n in result["reads"]) == total - (128 - 101) * 24
    # made whole, the weights are a world of one's, bit for bit
    assert merged.keys() == whole.keys()
    for name, value in whole.items():
        assert torch.equal(merged[name], value), name
    with torch.no_grad():
        expected = theirs(X).logits
        mine = ours(X)
        torch.testing.assert_close(mine[..., : expected.shape[-1]], expected, atol=1e-4, rtol=0)
    for result in results:
        if result["logits"] is not None:
            # the logits of the placed model itself: sharded (fsdp2) or split by the tensor plan (tp2)
            torch.testing.assert_close(result["logits"], mine, atol=1e-5, rtol=0)
    if "pipeline" in parallel:
        # each stage read only its own tensors: the first stage no final norm, the last no first block
        first, last = ({name for name, _ in r["reads"]} for r in (results[0], results[-1]))
        assert "model.norm.weight" not in first and "model.layers.0.mlp.up_proj.weight" not in last


def _bad(cfg: dict) -> str:
    """Rank r: the run's CheckpointError (the pool keeps its ranks)."""
    try:
        FromDirectory(cfg).fit()
    except CheckpointError as error:
        return str(error)
    return "started"


@pytest.mark.multiprocess
def test_a_truncated_shard_stops_every_rank_naming_the_file_and_a_tensor_it_holds(tmp_path):
    directory, _ = _directory(tmp_path, "qwen3")
    shard = sorted(directory.glob("*.safetensors"))[-1]
    with shard.open("r+b") as f:
        f.truncate(os.path.getsize(shard) - 100)
    messages = run_in_pool(_bad, 2, args=(_config(tmp_path / "run", directory, {}, {"mode": "fsdp2"}),), timeout=120)
    assert messages[0] == messages[1]
    assert f"{shard} (it holds 'model." in messages[0] and "cannot be read" in messages[0]


def test_a_missing_tensor_a_missing_shard_and_a_misshapen_tensor_are_named_with_their_file(tmp_path):
    from safetensors.torch import load_file, save_file

    directory, _ = _directory(tmp_path, "qwen3")
    shards = sorted(directory.glob("*.safetensors"))
    tensors = load_file(shards[0])
    name = next(iter(tensors))
    save_file({k: v for k, v in tensors.items() if k != name}, shards[0], metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{shards[0]}: the weights have no '{name}'"):
        gpt(init_from=str(directory))
    save_file({**tensors, name: torch.zeros(3)}, shards[0], metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{shards[0]}: tensor '{name}' has shape \[3\], but the model's"):
        gpt(init_from=str(directory))
    shards[-1].unlink()
    with pytest.raises(CheckpointError, match=rf"{shards[-1]} is missing \(it holds 'model\."):
        gpt(init_from=str(directory))


def test_a_pytorch_model_bin_is_read_mapped_into_the_same_weights(tmp_path):
    reference = save_tiny(tmp_path / "safe", "qwen2", shard=False)
    # the older format, as transformers 4.x wrote it: config.json beside a pickled state dict
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin/config.json").write_bytes((tmp_path / "safe/config.json").read_bytes())
    torch.save(reference.state_dict(), tmp_path / "bin/pytorch_model.bin")
    safe, pickled = gpt(init_from=str(tmp_path / "safe")), gpt(init_from=str(tmp_path / "bin"))
    for name, value in safe.state_dict().items():
        assert torch.equal(pickled.state_dict()[name], value), name


@pytest.mark.parametrize("kind", ["gpt2", "qwen3"])
def test_a_slice_read_in_blocks_of_a_few_rows_gives_the_same_bits(tmp_path, kind):
    directory, model = _directory(tmp_path, kind)
    whole = gpt(init_from=str(directory), **model).state_dict()
    # 100 elements a block: a few rows at a time, GPT-2's transposed Conv1D a few columns of its file at a time
    with mock.patch.object(hf_slices, "BLOCK", 100):
        blocks = gpt(init_from=str(directory), **model).state_dict()
    for name, value in whole.items():
        assert torch.equal(blocks[name], value), name
