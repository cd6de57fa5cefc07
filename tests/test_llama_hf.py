"""Hugging Face Llama-family directories in and out of ddpkit's model (issue 59): Llama, Qwen2, Qwen3 and Mistral
made tiny by transformers from their configs, saved sharded; nothing downloaded."""

from __future__ import annotations

import io
import json

import pytest
import torch
from helpers import run_in_pool
from hf_tiny import FAMILIES, fine_tune, save_tiny, to_4x_layout, tokens, write_tokenizer

from ddpkit.errors import CheckpointError, ConfigError
from ddpkit.models.gpt import gpt
from ddpkit.models.llama import Llama
from ddpkit.tools import generate
from ddpkit.tools.hf_export import export_hf
from ddpkit.tools.lm_source import load_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_init_from_gives_the_logits_of_transformers_within_1e_4(tmp_path, family):
    reference = save_tiny(tmp_path, family)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1 and ("lm_head.weight" in index) != reference.config.tie_word_embeddings
    model = gpt(init_from=str(tmp_path)).eval()
    assert isinstance(model, Llama) and model.shape.family == family
    config = reference.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert (model.kv_heads, model.head_dim) == (config.num_key_value_heads, head_dim)
    assert (model.head.weight is model.embed.weight) == reference.config.tie_word_embeddings
    x = tokens(48)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_transformers_4_config_layout_reads_the_same(tmp_path, family):
    reference = save_tiny(tmp_path, family)
    old = to_4x_layout(tmp_path)
    assert "rope_parameters" not in old and old["rope_theta"] == FAMILIES[family]["rope_parameters"]["rope_theta"]
    model = gpt(init_from=str(tmp_path)).eval()
    scaling = model.shape.rope_scaling
    assert scaling is None if family == "qwen2" else (scaling["rope_type"], scaling["factor"]) == ("llama3", 8.0)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens(48)), reference(tokens(48)).logits, atol=1e-4, rtol=0)


def test_a_sliding_window_narrower_than_the_context_is_refused_and_a_shorter_context_accepted(tmp_path):
    reference = save_tiny(tmp_path, "mistral", sliding_window=16)
    with pytest.raises(ConfigError, match=r"sliding window of 16 tokens, narrower than its context of 64.*max_len"):
        gpt(init_from=str(tmp_path))
    model = gpt(init_from=str(tmp_path), max_len=16).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(tokens(16)), reference(tokens(16)).logits, atol=1e-4, rtol=0)


def test_what_the_model_does_not_compute_is_refused_by_name(tmp_path):
    save_tiny(tmp_path / "yarn", "llama", rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0})
    with pytest.raises(
        ConfigError, match=r"RoPE scaling rule 'yarn' is not supported; ddpkit computes default, linear"
    ):
        gpt(init_from=str(tmp_path / "yarn"))
    save_tiny(tmp_path / "gelu", "qwen2", hidden_act="gelu")
    with pytest.raises(ConfigError, match=r"hidden_act 'gelu'; the Llama family's MLP is SwiGLU"):
        gpt(init_from=str(tmp_path / "gelu"))
    save_tiny(tmp_path / "qwen", "qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    save_tiny(tmp_path / "untied", "mistral", shard=False)
    with pytest.raises(ConfigError, match=r"sliding window of 8 tokens"):
        gpt(init_from=str(tmp_path / "qwen"))
    with pytest.raises(ConfigError, match=r"model.kwargs.kv_heads: 3 contradicts .*config.json, whose model has 2"):
        gpt(init_from=str(tmp_path / "untied"), kv_heads=3)
    with pytest.raises(ConfigError, match=r"model.kwargs.arch: 'gpt2' contradicts .*which is a llama model"):
        gpt(init_from=str(tmp_path / "untied"), arch="gpt2")
    weights = tmp_path / "untied/model.safetensors"
    from safetensors.torch import load_file, save_file

    save_file({k: v for k, v in load_file(weights).items() if k != "lm_head.weight"}, weights)
    with pytest.raises(CheckpointError, match=r"have no 'lm_head.weight'.*tie_word_embeddings is false"):
        gpt(init_from=str(tmp_path / "untied"))


def test_a_padded_vocabulary_is_cut_back_on_export_and_the_round_trip_is_bitwise(tmp_path):
    reference = save_tiny(tmp_path / "hf", "qwen3")
    write_tokenizer(tmp_path / "hf")
    model = gpt(init_from=str(tmp_path / "hf"), vocab_size=384).eval()
    x = tokens(20)
    with torch.no_grad():
        logits = model(x)
    assert logits.shape[-1] == 384 and torch.isneginf(logits[..., 320:]).all()
    run = tmp_path / "run"
    run.mkdir()
    torch.save(model.state_dict(), run / "model.pt")
    (run / "config.yaml").write_text(
        f"model: {{name: gpt, kwargs: {{init_from: {tmp_path / 'hf'}, vocab_size: 384}}}}\n"
    )
    line = export_hf(run, tmp_path / "out")
    assert "Qwen3ForCausalLM 2 x 32) + 3 tokenizer files" in line
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back).__name__ == "Qwen3ForCausalLM" and back.config.vocab_size == 320
    theirs, ours = reference.state_dict(), back.state_dict()
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in ours)
    assert (tmp_path / "out/tokenizer.json").read_bytes() == (tmp_path / "hf/tokenizer.json").read_bytes()


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_exported_directories_load_in_transformers_to_the_same_logits(tmp_path, family):
    save_tiny(tmp_path / "hf", family)
    model = gpt(init_from=str(tmp_path / "hf")).eval()
    with torch.no_grad():
        # a "fine-tune": every weight moved, so the export cannot pass by copying the input files
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.01)
    run = tmp_path / "run"
    run.mkdir()
    torch.save(model.state_dict(), run / "model.pt")
    (run / "config.yaml").write_text(f"model: {{name: gpt, kwargs: {{init_from: {tmp_path / 'hf'}}}}}\n")
    export_hf(run, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    x = tokens(48)
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, model(x), atol=1e-4, rtol=0)


def test_generate_reads_the_tokenizer_json_beside_init_from(tmp_path):
    save_tiny(tmp_path / "hf", "llama")
    write_tokenizer(tmp_path / "hf")
    run = tmp_path / "run"
    run.mkdir()
    torch.save(gpt(init_from=str(tmp_path / "hf")).state_dict(), run / "model.pt")
    (run / "config.yaml").write_text(f"model: {{name: gpt, kwargs: {{init_from: {tmp_path / 'hf'}}}}}\n")
    outputs = []
    for cache in ([], ["--no-cache"]):
        out = io.StringIO()
        argv = [str(run), "--prompt", "def main", "--max-new-tokens", "12", "--temperature", "0", *cache]
        assert generate.main(argv, out=out) == 0
        outputs.append(out.getvalue())
    assert outputs[0].startswith("def main") and outputs[0] == outputs[1]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_fine_tuned_on_two_ranks_and_exported_back(tmp_path, mode):
    reference = save_tiny(tmp_path / "hf", "qwen2")
    train = {"activation_checkpointing": True}
    run_in_pool(fine_tune, 2, args=(str(tmp_path / "hf"), str(tmp_path / "run"), mode, train), timeout=240)
    model, _ = load_model(tmp_path / "run")
    x = tokens(32, vocab=257)
    # model.pt, and the (DCP under fsdp2) checkpoint
    for source in (tmp_path / "run", next((tmp_path / "run/checkpoints").glob("step-*"))):
        export_hf(source, tmp_path / "out")
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
        with torch.no_grad():
            torch.testing.assert_close(back(x).logits, model(x), atol=1e-4, rtol=0)
            assert (back(x).logits - reference(x).logits).abs().max() > 1e-3
