"""Sampling from language models (issue 44): the KV cache gives the uncached model's tokens, seeds reproduce,
``ddpkit generate`` streams text from a run and refuses what cannot work in one line."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from helpers import run_in_pool

import ddpkit
from ddpkit.data.text_codec import TextCodec
from ddpkit.errors import ConfigError
from ddpkit.models.generation import generate
from ddpkit.models.gpt import GPT
from ddpkit.tools.generate import main as generate_main
from ddpkit.training.samples import TrainingSamples


def small(**kwargs) -> GPT:
    torch.manual_seed(0)
    return GPT(**{"vocab_size": 257, "dim": 32, "depth": 2, "heads": 4, "max_len": 64, **kwargs}).eval()


PROMPT = list(b"def main(")


def test_cached_logits_equal_the_full_forward_at_every_position():
    model, x = small(), torch.randint(0, 257, (2, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(x)
        cache = model.make_cache(2)
        pieces = [model(x[:, :10], cache=cache)] + [model(x[:, i : i + 1], cache=cache) for i in range(10, 30)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=0)


def test_greedy_is_identical_with_and_without_the_cache():
    model = small()
    cached = list(generate(model, PROMPT, max_new_tokens=40, temperature=0))
    uncached = list(generate(model, PROMPT, max_new_tokens=40, temperature=0, use_cache=False))
    assert cached == uncached and len(cached) == 40


def test_a_seeded_sample_is_reproducible_and_seeds_differ():
    model = small()
    first, again, other = (
        list(generate(model, PROMPT, max_new_tokens=30, top_k=50, top_p=0.95, seed=s)) for s in (1, 1, 2)
    )
    assert first == again and first != other
    assert list(generate(model, PROMPT, max_new_tokens=30, top_k=1, seed=5)) == list(
        generate(model, PROMPT, max_new_tokens=30, temperature=0)
    )  # top-1 is greedy


def test_stops_at_end_of_text_and_at_the_context():
    model = small()
    greedy = list(generate(model, PROMPT, max_new_tokens=40, temperature=0))
    assert (
        list(generate(model, PROMPT, max_new_tokens=40, temperature=0, eot=greedy[5]))
        == greedy[: greedy.index(greedy[5])]
    )
    assert len(list(generate(model, PROMPT, max_new_tokens=1000, temperature=0))) == 64 - len(PROMPT)


class NoCache(torch.nn.Module):
    """A user model following the protocol without a cache: a bigram table."""

    max_len, vocab_size = 16, 257

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(257, 257)

    def forward(self, tokens):
        return self.table(tokens)


def test_a_user_model_without_a_cache_is_sampled_through_the_protocol():
    model = NoCache()
    assert len(list(generate(model, [1, 2], max_new_tokens=50, temperature=0))) == 14


def _run(tmp_path, model: GPT):
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    torch.save(model.state_dict(), run / "model.pt")
    (run / "config.yaml").write_text(
        "model: {name: gpt, kwargs: {vocab_size: 257, dim: 32, depth: 2, heads: 4, max_len: 64}}\n"
    )
    return run


def _cli(*argv) -> str:
    out = io.StringIO()
    assert generate_main([*map(str, argv)], out=out) == 0
    return out.getvalue()


def test_ddpkit_generate_streams_the_prompt_and_its_continuation_from_a_run(tmp_path):
    model = small()
    run = _run(tmp_path, model)
    greedy = _cli(run, "--prompt", "def main(", "--temperature", "0", "--max-new-tokens", "20")
    codec = TextCodec.open(None)
    expected = codec.decode(list(generate(model, PROMPT, max_new_tokens=20, temperature=0, eot=256)))
    assert greedy == "def main(" + expected + "\n"
    assert _cli(run, "--prompt", "def main(", "--temperature", "0", "--max-new-tokens", "20", "--no-cache") == greedy
    three = _cli(run, "--prompt", "x", "--num-samples", "3", "--max-new-tokens", "10")
    assert three.count("---------------") == 2 and three == _cli(
        run, "--prompt", "x", "--num-samples", "3", "--max-new-tokens", "10"
    )


def test_generate_refuses_a_prompt_longer_than_the_context_and_a_tokenizer_too_big(tmp_path):
    run = _run(tmp_path, small())
    with pytest.raises(ConfigError, match=r"--prompt: 100 tokens, but the model's context is 64 .*shorten the prompt"):
        _cli(run, "--prompt", "a" * 100)
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"w{i}": i for i in range(300)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ConfigError, match=r"--tokenizer: .*tokenizer.json has 300 ids but the model scores 257"):
        _cli(run, "--tokenizer", tmp_path / "tokenizer.json")


def test_train_sample_writes_samples_to_the_log_jsonl_and_tensorboard(tmp_path, capfd):
    pytest.importorskip("tensorboard")
    config = {
        "run": {"output_dir": str(tmp_path / "run")},
        "log": {"progress_bar": False, "tensorboard": True},
        "model": {"name": "gpt", "kwargs": {"vocab_size": 257, "dim": 32, "depth": 2, "heads": 4, "max_len": 64}},
        "data": {"name": "tokens", "batch_size": 4, "kwargs": {"corpus": "stdlib", "seq_len": 32}},
        "optim": {"name": "adamw", "lr": 1e-3},
        "train": {"max_steps": 4, "eval_every": 100, "log_every": 2},
        "checkpoint": {"every_steps": None, "every_epochs": None},
    }
    config["train"]["sample"] = {"every_steps": 2, "prompt": "def ", "max_new_tokens": 12, "temperature": 0}
    trainer = ddpkit.Trainer(config)  # train.sample's listener is in the Trainer's event list
    trainer.fit()
    lines = [json.loads(line) for line in (tmp_path / "run/samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["prompt"]) for r in lines] == [(2, "def "), (4, "def ")]
    codec = TextCodec.open(None)
    expected = codec.decode(
        list(generate(trainer.unwrapped_model.eval(), list(b"def "), max_new_tokens=12, temperature=0, eot=256))
    )
    assert lines[-1]["text"] == expected  # the finished model's greedy continuation
    assert f"sample at step 4: {'def ' + expected!r}" in capfd.readouterr().err
    assert list((tmp_path / "run/tensorboard").glob("events.out.tfevents.*"))


def test_train_sample_is_off_by_default_and_refuses_a_prompt_too_long():
    from ddpkit.config.loader import load_config

    assert TrainingSamples.for_run(load_config({}), rank=0, model=small(), outside=None) is None
    cfg = load_config({"train": {"sample": {"prompt": "x" * 80}}})
    with pytest.raises(ConfigError, match=r"train.sample.prompt: 80 tokens, but the model's context is 64"):
        TrainingSamples.for_run(cfg, rank=0, model=small(), outside=None)


def test_a_missing_run_is_one_line_naming_what_to_give(tmp_path):
    with pytest.raises(ConfigError, match=r"nowhere: no such run directory or checkpoint; give a run's output_dir"):
        _cli(tmp_path / "nowhere")


def _sample_in_fsdp2(out: str, split: bool = False) -> list[dict]:
    """Rank r: 2 steps of a byte GPT under fsdp2 with train.sample every step; rank 0's samples.jsonl lines.
    ``split``: the vocabulary split over the ranks (``parallel.fsdp.shard_vocabulary``), padded to 258 rows."""
    vocab = {"vocab_size": 258, "valid_vocab": 257} if split else {"vocab_size": 257}
    ddpkit.Trainer(
        {
            "run": {"output_dir": out},
            "log": {"progress_bar": False},
            "dist": {"timeout": 60},
            "model": {"name": "gpt", "kwargs": {**vocab, "dim": 32, "depth": 2, "heads": 4, "max_len": 64}},
            "data": {"name": "tokens", "batch_size": 4, "kwargs": {"corpus": "stdlib", "seq_len": 32}},
            "optim": {"name": "adamw", "lr": 1e-3},
            "parallel": {"mode": "fsdp2", "fsdp": {"shard_vocabulary": split}},
            "train": {
                "max_steps": 2,
                "eval_every": 100,
                "sample": {"every_steps": 1, "prompt": "def ", "max_new_tokens": 8},
            },
            "checkpoint": {"every_steps": None, "every_epochs": None},
        }
    ).fit()
    path = Path(out) / "samples.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("split", [False, True], ids=["fsdp2", "vocabulary_split"])
def test_train_sample_under_fsdp2_samples_on_every_rank_and_rank_0_writes(tmp_path, split):
    first, _ = run_in_pool(_sample_in_fsdp2, 2, args=(str(tmp_path / "run"), split), timeout=240)
    assert [r["step"] for r in first] == [1, 2] and all(len(r["text"]) > 0 for r in first)
