"""Hugging Face GPT-2 directories in and out of ddpkit's gpt model (issue 44): nothing downloaded, a small GPT-2
is built from a GPT2Config and saved with save_pretrained."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import REPO, load_script, run_cli, run_in_pool
from hf_tiny import fine_tune

from ddpkit.data.tokens import require_vocab_of
from ddpkit.data.tokens import tokens as token_datasets
from ddpkit.errors import CheckpointError, ConfigError, DataError
from ddpkit.models.gpt import gpt
from ddpkit.tools.hf_export import export_hf
from ddpkit.tools.lm_source import load_model

transformers = pytest.importorskip("transformers")

SHAPE = {"vocab_size": 101, "n_positions": 32, "n_embd": 24, "n_layer": 2, "n_head": 3}


def save_hf_gpt2(directory, *, safe: bool = True, **config) -> torch.nn.Module:
    """A random GPT2LMHeadModel of SHAPE (overridden by ``config``), written to ``directory``; returned in eval mode."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**SHAPE, **config})).eval()
    with torch.no_grad():  # biases and norms are zero/one at init: make them matter
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(directory, safe_serialization=safe)
    return model


def tokens(n: int = 20, vocab: int = SHAPE["vocab_size"]) -> torch.Tensor:
    return torch.randint(0, vocab, (2, n), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "pytorch_model.bin"])
def test_logits_equal_the_hugging_face_models_within_1e_4(tmp_path, safe):
    reference = save_hf_gpt2(tmp_path, safe=safe)
    model = gpt(init_from=str(tmp_path)).eval()
    assert (model.vocab_size, model.dim, model.depth, model.heads, model.max_len, model.activation) == (
        101,
        24,
        2,
        3,
        32,
        "gelu_tanh",
    )
    with torch.no_grad():
        torch.testing.assert_close(model(tokens()), reference(tokens()).logits, atol=1e-4, rtol=0)


def test_a_padded_vocabulary_never_predicts_the_padding_and_keeps_the_loss(tmp_path):
    reference = save_hf_gpt2(tmp_path)
    padded = gpt(init_from=str(tmp_path), vocab_size=128).eval()  # 101 ids padded to 128
    x = tokens()
    with torch.no_grad():
        logits, expected = padded(x), reference(x).logits
    assert logits.shape[-1] == 128 and torch.isneginf(logits[..., 101:]).all()
    torch.testing.assert_close(logits[..., :101], expected, atol=1e-4, rtol=0)
    y = tokens()
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
    torch.testing.assert_close(
        loss, torch.nn.functional.cross_entropy(expected.flatten(0, 1), y.flatten()), atol=1e-5, rtol=0
    )
    padded.train()
    padded(x).logsumexp(-1).mean().backward()
    assert torch.isfinite(padded.embed.weight.grad).all() and padded.embed.weight.grad[101:].abs().max() == 0


def test_exact_gelu_is_read_from_activation_function_and_max_len_may_crop(tmp_path):
    reference = save_hf_gpt2(tmp_path, activation_function="gelu")
    model = gpt(init_from=str(tmp_path), max_len=16).eval()
    assert (model.activation, model.max_len) == ("gelu", 16)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens(16)), reference(tokens(16)).logits, atol=1e-4, rtol=0)


def test_mistakes_are_one_line_naming_the_file_or_key(tmp_path):
    with pytest.raises(
        ConfigError, match=r"init_from: .*empty has no config.json; give a directory written by save_pretrained"
    ):
        gpt(init_from=str(tmp_path / "empty"))
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(
        ConfigError, match=r"is a .bert. model; the gpt model loads gpt2, llama.*examples/hf_causal_lm.py"
    ):
        gpt(init_from=str(llama))
    save_hf_gpt2(tmp_path / "gpt2")
    with pytest.raises(
        ConfigError,
        match=r"model.kwargs.dim: 32 contradicts .*gpt2/config.json, whose model has 24 .*drop model.kwargs.dim",
    ):
        gpt(init_from=str(tmp_path / "gpt2"), dim=32)
    with pytest.raises(ConfigError, match=r"model.kwargs.vocab_size: 64 contradicts .*at least"):
        gpt(init_from=str(tmp_path / "gpt2"), vocab_size=64)
    with pytest.raises(ConfigError, match=r"model.kwargs.activation: 'gelu' contradicts"):
        gpt(init_from=str(tmp_path / "gpt2"), activation="gelu")
    with pytest.raises(ConfigError, match=r"model.kwargs.preset: give either preset or init_from"):
        gpt(init_from=str(tmp_path / "gpt2"), preset="gpt2")
    (tmp_path / "gpt2/model.safetensors").unlink()
    with pytest.raises(
        CheckpointError, match=r"has a config.json but no weights \(model.safetensors or pytorch_model.bin\)"
    ):
        gpt(init_from=str(tmp_path / "gpt2"))


def test_export_of_an_unchanged_model_gives_back_the_directory_bit_for_bit(tmp_path):
    reference = save_hf_gpt2(tmp_path / "hf", vocab_size=SHAPE["vocab_size"])
    model = gpt(init_from=str(tmp_path / "hf"), vocab_size=128)  # padded on the way in, cut back on the way out
    run = tmp_path / "run"
    run.mkdir()
    torch.save(model.state_dict(), run / "model.pt")
    (run / "config.yaml").write_text(
        f"model: {{name: gpt, kwargs: {{init_from: {tmp_path / 'hf'}, vocab_size: 128}}}}\n"
    )
    line = export_hf(run, tmp_path / "out")
    assert line.startswith(f"wrote {tmp_path / 'out'}: config.json + model.safetensors (")
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    assert back.config.vocab_size == 101 and back.config.activation_function == "gelu_new"
    theirs, ours = reference.state_dict(), back.state_dict()
    assert all(torch.equal(theirs[k], ours[k]) for k in ours if not k.endswith(".attn.bias"))


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_hugging_face_to_ddpkit_fine_tuned_on_two_ranks_and_back(tmp_path, mode):
    reference = save_hf_gpt2(tmp_path / "hf", vocab_size=257)
    run_in_pool(fine_tune, 2, args=(str(tmp_path / "hf"), str(tmp_path / "run"), mode), timeout=240)
    model, _ = load_model(tmp_path / "run")
    x = tokens(vocab=257)
    for source in (
        tmp_path / "run",
        next((tmp_path / "run/checkpoints").glob("step-*")),
    ):  # model.pt, and the (DCP) checkpoint
        export_hf(source, tmp_path / "out")
        back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
        with torch.no_grad():
            torch.testing.assert_close(back(x).logits, model(x), atol=1e-4, rtol=0)
            assert (back(x).logits - reference(x).logits).abs().max() > 1e-3  # it did train


def test_the_hugging_face_example_loads_any_local_causal_lm(tmp_path):
    example = load_script(REPO / "examples/hf_causal_lm.py")
    saved = save_hf_gpt2(tmp_path / "hf", vocab_size=257, n_positions=64)
    config = {"run": {"output_dir": str(tmp_path / "run")}, "model": {"kwargs": {"pretrained": str(tmp_path / "hf")}}}
    model = example.CausalLMTrainer(config).build_model()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), saved.state_dict().values()))
    with pytest.raises(ConfigError, match=r"model.kwargs.pretrained: .*nowhere is not a local causal LM directory"):
        example.CausalLMTrainer({"model": {"kwargs": {"pretrained": str(tmp_path / "nowhere")}}}).build_model()


@pytest.mark.slow
def test_the_finetune_config_run_generate_and_export_from_the_command_line(tmp_path):
    """configs/finetune_gpt2.yaml as a user runs it (a small local GPT-2, the stdlib bytes); generate; export."""
    save_hf_gpt2(tmp_path / "hf", vocab_size=257, n_positions=64)
    run = tmp_path / "run"
    overrides = [  # the HF directory's own 257 ids (no padding): the whole validation set takes a second
        f"model.kwargs={{init_from: {tmp_path / 'hf'}}}",
        "data.kwargs={corpus: stdlib, seq_len: 32}",
        "data.batch_size=2",
        "data.val_batch_size=64",
        "train.max_steps=2",
        "train.grad_accum_steps=1",
        "train.precision=fp32",
        "train.sample=null",
        f"run.output_dir={run}",
        "checkpoint.every_steps=2",
    ]
    train = run_cli("run", "configs/finetune_gpt2.yaml", "--nproc-per-node", "1", *overrides)
    assert train.returncode == 0, train.stderr[-3000:]
    generated = run_cli("generate", str(run), "--prompt", "def ", "--max-new-tokens", "8", "--temperature", "0")
    assert generated.returncode == 0 and generated.stdout.startswith("def "), generated.stderr[-2000:]
    exported = run_cli("export", str(run), str(tmp_path / "out"), "--format", "hf")
    assert exported.returncode == 0, exported.stderr[-2000:]
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    model, _ = load_model(run)
    assert back.config.vocab_size == model.vocab_size == 257
    x = tokens(vocab=257)
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, model(x), atol=1e-4, rtol=0)


def test_a_token_id_in_the_padding_is_a_data_error_not_an_infinite_loss(tmp_path):
    save_hf_gpt2(tmp_path / "hf")
    padded = gpt(init_from=str(tmp_path / "hf"), vocab_size=128)  # ids 101..127 are padding, their logits -inf
    np.array([1, 2, 3, 120, 4, 5, 6, 7, 8], dtype=np.uint16).tofile(tmp_path / "ids.bin")
    train, _ = token_datasets(path=str(tmp_path / "ids.bin"), seq_len=4)
    require_vocab_of(padded, train)
    with pytest.raises(DataError, match=r"token id 120 at token offset 3 is outside the model's vocabulary \[0, 101\)"):
        train[0]
