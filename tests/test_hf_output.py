"""Issue 67: a split model's final weights as a Hugging Face directory, each rank writing what it holds.

    .venv/bin/pytest -q tests/test_hf_output.py

A run of one step under pp2, tp2 and fsdp2 (2 Gloo ranks), pp2 x tp2, HSDP (fsdp2, 2 replicas of 2 shards) and pp2 x dp2
(ddp or fsdp2 inside each stage) on 4, and bf16 autocast under fsdp2 and pp2 x tp2, writes ``hf/``: transformers loads
it and gives ddpkit's logits of it (within 1e-5, both fp32), ``init_from`` of it gives the trained weights bit for bit,
every piece of every tensor was written by exactly one rank (a replica's copy never twice), and the files hold fp32 (a
bf16 run's parameters are fp32 masters). A tiny model fits the host, so ``checkpoint.model_pt: auto`` writes
``model.pt`` too (under a pipeline the stages sent to rank 0 one tensor at a time), equal to the same weights; ``false``
writes none; a world of one writes ``model.pt`` and no ``hf/``, as before.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import RaggedSequences, run_in_pool
from hf_tiny import save_tiny, tokens, write_tokenizer
from storage_server import s3_server, s3_url  # noqa: F401 (fixtures, found by name)

import ddpkit
from ddpkit.checkpoint.final_outputs import final_outputs
from ddpkit.checkpoint.hf_output import hf_views
from ddpkit.checkpoint.storage.store import open_store
from ddpkit.models.gpt import gpt, resolve
from ddpkit.testing import run_on_ranks
from ddpkit.tools.hf_export import write_hf_directory
from ddpkit.tools.lm_source import ModelSpec

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytestmark = pytest.mark.timeout(200)

X = tokens(12, vocab=50)


class Trained(ddpkit.Trainer):
    """One step on ragged token sequences; keeps its final weights, made whole."""

    def build_datasets(self):
        return RaggedSequences(n=8, vocab=50), None


def _run(cfg: dict) -> dict[str, torch.Tensor]:
    """Rank r: train, then the weights this rank holds, made whole (a DTensor's full_tensor: every rank of its mesh)."""
    trainer = Trained(cfg)
    trainer.fit()
    state = trainer.placed.held.state_dict()
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()}


def _run_recording_writes(cfg: dict) -> tuple[dict[str, torch.Tensor], list[tuple[str, tuple[int, ...], int]]]:
    """Rank r: :func:`_run`, and the pieces this rank gave DCP's Hugging Face writer: ``(name, offset, numel)``."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    from ddpkit.checkpoint import hf_output

    writes = []

    class Recording(HuggingFaceStorageWriter):
        def write_data(self, plan, planner):
            for item in plan.items:
                chunk = item.tensor_data.chunk
                writes.append((item.index.fqn, tuple(chunk.offsets), chunk.sizes.numel()))
            return super().write_data(plan, planner)

    hf_output.HuggingFaceStorageWriter = Recording
    try:
        return _run(cfg), writes
    finally:
        hf_output.HuggingFaceStorageWriter = HuggingFaceStorageWriter


def _config(out: Path, kwargs: dict, parallel: dict, *, train: dict | None = None, **checkpoint) -> dict:
    pipelined = parallel.get("pipeline", 1) > 1
    return {
        "run": {"name": "hf-out", "output_dir": str(out), "seed": 3},
        "data": {"global_batch_size": 4},
        "model": {"name": "gpt", "kwargs": {"max_len": 16, **kwargs}},
        "optim": {"name": "adamw", "lr": 1e-2},
        "train": {"max_steps": 1, **(train or {})},
        "parallel": {**parallel, **({"microbatches": 2} if pipelined else {})},
        "checkpoint": {"every_epochs": None, **checkpoint},
        "log": {"progress_bar": False},
    }


def _source(tmp_path: Path, kind: str) -> dict:
    """The model kwargs of ``kind``: a tiny Hugging Face directory to start from (a padded GPT-2: 101 ids to 128)."""
    directory = tmp_path / f"from-{kind}"
    if kind == "gpt2-padded":
        torch.manual_seed(0)
        config = transformers.GPT2Config(vocab_size=101, n_positions=32, n_embd=24, n_layer=2, n_head=2)
        transformers.GPT2LMHeadModel(config).save_pretrained(directory)
        return {"init_from": str(directory), "vocab_size": 128}
    save_tiny(directory, kind)
    write_tokenizer(directory)
    return {"init_from": str(directory)}


#: bf16 autocast: the parameters stay fp32 masters (fsdp2 casts a copy per step, autocast per op)
BF16 = {"precision": "bf16"}
#: (model, parallel, train, checkpoint, ranks). pp2 on an untied Qwen2, tp2 on a tied Llama with biases (model.pt
#: turned off), fsdp2 on GPT-2 (transposed Conv1D weights, a padded vocabulary cut back), pp2 x tp2; then layouts where
#: a tensor has several holders that must write it once: HSDP (2 replicas of 2 shards), pp2 x dp2 (ddp, and fsdp2 on
#: GPT-2, inside each stage); bf16 under fsdp2 and pp2 x tp2; fsdp2 with the vocabulary split
#: (``parallel.fsdp.shard_vocabulary``). A tiny model fits the host: ``auto`` writes model.pt.
CASES = [
    pytest.param("qwen2", {"pipeline": 2}, {}, {}, 2, id="pp2"),
    pytest.param("llama", {"tensor": 2}, {}, {"model_pt": False}, 2, id="tp2"),
    pytest.param("gpt2-padded", {"mode": "fsdp2"}, {}, {}, 2, id="fsdp2"),
    pytest.param("qwen2", {"pipeline": 2, "tensor": 2}, {}, {}, 4, id="pp2-tp2"),
    pytest.param("llama", {"mode": "fsdp2", "replicate": 2}, {}, {}, 4, id="hsdp"),
    pytest.param("qwen2", {"pipeline": 2, "mode": "ddp"}, {}, {}, 4, id="pp2-ddp2"),
    pytest.param("gpt2-padded", {"pipeline": 2, "mode": "fsdp2"}, {}, {}, 4, id="pp2-fsdp2"),
    pytest.param("qwen2", {"mode": "fsdp2"}, BF16, {}, 2, id="fsdp2-bf16"),
    pytest.param("llama", {"pipeline": 2, "tensor": 2}, BF16, {}, 4, id="pp2-tp2-bf16"),
    # the tied Llama's one vocabulary matrix split by rows outside FSDP2's units
    pytest.param("llama", {"mode": "fsdp2", "fsdp": {"shard_vocabulary": True}}, {}, {}, 2, id="fsdp2-vocab-split"),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("kind", "parallel", "train", "checkpoint", "ranks"), CASES)
def test_a_split_model_is_written_by_its_ranks_and_loads_in_transformers_and_init_from(
    tmp_path, kind, parallel, train, checkpoint, ranks
):
    kwargs = _source(tmp_path, kind)
    out = tmp_path / "run"
    cfg = _config(out, kwargs, parallel, train=train, **checkpoint)
    results = run_in_pool(_run_recording_writes, ranks, args=(cfg,), timeout=180)
    trained = {k: v for weights, _ in results for k, v in weights.items()}
    directory = out / "hf"
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in directory.glob("*.safetensors"))
    # one file per rank's share of the blocks (2 blocks), nothing of DCP's pieces or the partial directory left
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert set(index["weight_map"].values()) == set(files)
    assert sorted(p.name for p in out.iterdir() if "hf" in p.name) == ["hf"] and not (directory / "sharded").exists()
    assert (out / "model.pt").exists() == checkpoint.get("model_pt", True)
    _assert_each_piece_written_once([writes for _, writes in results], directory)
    # fp32 files, bf16 runs included: what the run trains and keeps is its fp32 parameters (autocast computes in bf16)
    assert json.loads((directory / "config.json").read_text())["torch_dtype"] == "float32"
    # complete for transformers as ddpkit export writes it: init_from's tokenizer beside the weights
    assert (directory / "tokenizer.json").is_file() == (kind != "gpt2-padded")
    _assert_loads_as_trained(directory, trained, kwargs)
    if checkpoint.get("model_pt", True):
        # the pipeline's stages sent to rank 0 one tensor at a time: the same weights
        whole = torch.load(out / "model.pt", weights_only=True)
        assert whole.keys() == trained.keys() and all(torch.equal(whole[k], trained[k]) for k in whole)


def _assert_each_piece_written_once(writes: list[list[tuple[str, tuple[int, ...], int]]], directory: Path) -> None:
    """Every tensor of the directory's files came from its ranks' pieces exactly once: no piece written by two
    replicas (HSDP's, a data-parallel copy of a stage), none missing; and every file holds fp32."""
    from safetensors import safe_open

    pieces = [(name, offset) for rank in writes for name, offset, _ in rank]
    assert len(pieces) == len(set(pieces)), "a piece written by more than one rank"
    written: dict[str, int] = {}
    for rank in writes:
        for name, _, numel in rank:
            written[name] = written.get(name, 0) + numel
    stored = {}
    for file in directory.glob("*.safetensors"):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                stored[name] = f.get_slice(name).get_shape(), f.get_slice(name).get_dtype()
    assert {name: dtype for name, (_, dtype) in stored.items()} == dict.fromkeys(stored, "F32")
    assert written == {name: torch.Size(shape).numel() for name, (shape, _) in stored.items()}


def _assert_loads_as_trained(directory: Path, trained: dict[str, torch.Tensor], kwargs: dict) -> None:
    """``init_from`` of ``directory`` gives the trained weights bit for bit (GPT-2's pad rows come back as zeros, as
    trained), and transformers' logits of it are ddpkit's within 1e-5 (both fp32)."""
    reloaded = gpt(init_from=str(directory), max_len=16, vocab_size=kwargs.get("vocab_size")).eval()
    assert reloaded.state_dict().keys() == trained.keys()
    for name, value in reloaded.state_dict().items():
        assert torch.equal(value, trained[name]), name
    theirs = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = theirs(X).logits
        torch.testing.assert_close(reloaded(X)[..., : expected.shape[-1]], expected, atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_with_a_url_checkpoint_dir_hf_goes_up_whole_and_loads_from_the_bucket(s3_server, s3_url, tmp_path):  # noqa: F811
    kwargs = _source(tmp_path, "gpt2-padded")
    out = tmp_path / "run"
    cfg = _config(out, kwargs, {"mode": "fsdp2"}, dir=s3_url)
    # fresh ranks, not the pool's: an S3 client's IO thread (fsspec's, one a process) outlives the run
    results = run_on_ranks(_run, 2, args=(cfg,), timeout=180, env=s3_server.env())
    trained = {k: v for result in results for k, v in result.items()}
    # another machine: hf/ read back from the bucket through ddpkit's store
    store = open_store(s3_url)
    local = out / "hf"
    assert sorted(store.listing("hf/")) == sorted(f"hf/{f.name}" for f in local.iterdir())
    downloaded = tmp_path / "downloaded"
    downloaded.mkdir()
    for key in store.listing("hf/"):
        store.get_file(key, downloaded / key.removeprefix("hf/"))
    assert all((downloaded / f.name).read_bytes() == f.read_bytes() for f in local.iterdir())
    _assert_loads_as_trained(downloaded, trained, kwargs)
    # model.pt goes up as before (auto: the tiny model fits the host)
    assert store.get_bytes("model.pt") == (out / "model.pt").read_bytes()


@pytest.mark.multiprocess
def test_a_world_of_one_writes_model_pt_and_no_directory(tmp_path):
    kwargs = _source(tmp_path, "qwen3")
    out = tmp_path / "run"
    (trained,) = run_in_pool(_run, 1, args=(_config(out, kwargs, {}),), timeout=120)
    assert not (out / "hf").exists()
    whole = torch.load(out / "model.pt", weights_only=True)
    assert whole.keys() == trained.keys() and all(torch.equal(whole[k], trained[k]) for k in whole)


def _run_on_a_small_host(cfg: dict) -> dict[str, torch.Tensor]:
    """Rank r: :func:`_run` where no model fits rank 0's host (the share of its available memory is 0)."""
    from ddpkit.checkpoint import final_outputs

    final_outputs.HOST_SHARE = 0.0
    try:
        return _run(cfg)
    finally:
        final_outputs.HOST_SHARE = 0.25


@pytest.mark.multiprocess
def test_auto_writes_no_model_pt_for_a_split_model_that_does_not_fit_rank_0s_host(tmp_path):
    kwargs = _source(tmp_path, "qwen3")
    out = tmp_path / "run"
    run_in_pool(_run_on_a_small_host, 2, args=(_config(out, kwargs, {"mode": "fsdp2"}),), timeout=120)
    assert (out / "hf" / "model.safetensors.index.json").is_file() and not (out / "model.pt").exists()


@pytest.mark.multiprocess
def test_a_model_its_family_cannot_describe_writes_model_pt_in_place_of_the_directory(tmp_path):
    # qwen2 has q/k/v biases; this model has none: no config.json can describe it, and the run still ends well
    kwargs = {"arch": "llama", "family": "qwen2", "vocab_size": 50, "dim": 16, "depth": 2, "heads": 2}
    out = tmp_path / "run"
    results = run_in_pool(_run, 2, args=(_config(out, kwargs, {"mode": "fsdp2"}),), timeout=120)
    assert not (out / "hf").exists() and not (out / "hf.partial").exists()
    whole = torch.load(out / "model.pt", weights_only=True)
    assert all(torch.equal(whole[k], results[0][k]) for k in results[0])


def _save_on_a_disk_of_its_own(base: str, kwargs: dict) -> str | None:
    """Rank r: the whole model written to ``base/node-r/hf``: each rank's own disk, as on nodes sharing none."""
    import torch.distributed as dist

    from ddpkit.checkpoint.hf_output import save_hf_directory

    rank = dist.get_rank()
    torch.manual_seed(0)
    return save_hf_directory(gpt(**kwargs), Path(base, f"node-{rank}", "hf"), model_kwargs=kwargs, rank=rank)


@pytest.mark.multiprocess
def test_ranks_that_share_no_disk_write_no_directory_and_say_why(tmp_path):
    # each node would join only its own pieces into rank 0's directory: holes, under a config.json
    kwargs = {"arch": "llama", "family": "llama", "vocab_size": 50, "dim": 16, "depth": 2, "heads": 2, "max_len": 16}
    answers = run_in_pool(_save_on_a_disk_of_its_own, 2, args=(str(tmp_path), kwargs), timeout=120)
    assert all("is not one filesystem every rank sees: rank(s) 1 do not see rank 0's hf.partial" in a for a in answers)
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_the_rule_names_which_outputs_a_run_writes():
    # hf/ for a split gpt model; model.pt (auto) where each rank holds the model, where no Hugging Face form exists,
    # or where the whole model fits a share of rank 0's host
    assert final_outputs("auto", splits_model=False, hf_form=True, fits_host=False) == (True, False)
    assert final_outputs("auto", splits_model=True, hf_form=True, fits_host=False) == (False, True)
    assert final_outputs("auto", splits_model=True, hf_form=True, fits_host=True) == (True, True)
    assert final_outputs("auto", splits_model=True, hf_form=False, fits_host=False) == (True, False)
    assert final_outputs(True, splits_model=True, hf_form=True, fits_host=False) == (True, True)
    assert final_outputs(False, splits_model=False, hf_form=True, fits_host=True) == (False, False)


@pytest.mark.parametrize("kind", ["gpt2-padded", "qwen2", "llama"])
def test_each_rank_s_views_are_the_export_s_tensors(tmp_path, kind):
    # hf_views (a rank's part, renamed in place) and ddpkit export --format hf (the whole model) agree bit for bit
    kwargs = {**_source(tmp_path, kind), "max_len": 16}
    model = gpt(**kwargs)
    arch, resolved = resolve(kwargs)
    views = hf_views(model.state_dict(), arch=arch, kwargs=resolved)
    spec = ModelSpec(name="gpt", kwargs=kwargs, weights=model.state_dict(), source="test")
    write_hf_directory(spec, model.state_dict(), tmp_path / "export")
    from safetensors.torch import load_file

    exported = load_file(tmp_path / "export" / "model.safetensors")
    assert views.keys() == exported.keys()
    for name, value in exported.items():
        assert torch.equal(views[name], value), name
