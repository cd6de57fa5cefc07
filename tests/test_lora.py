"""LoRA (``model.lora``, issue 59): the adapter on a frozen base, checkpoints of the adapter and the base's
fingerprint, merge, and the files peft's own loader reads; tiny models made by transformers, nothing downloaded.

.venv/bin/pytest tests/test_lora.py -q
"""

from __future__ import annotations

import json

import pytest
import torch
from hf_tiny import fit, lora_run, save_tiny, token_files, tokens

import ddpkit
from ddpkit.config.lora_section import LoraConfig
from ddpkit.config.schema import ModelConfig
from ddpkit.errors import CheckpointError, ConfigError
from ddpkit.models.gpt import gpt
from ddpkit.models.lora import LoraLinear, apply_lora, lora_targets, merge_lora
from ddpkit.tools.hf_export import export_hf, export_peft
from ddpkit.tools.lm_source import load_model

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytestmark = pytest.mark.timeout(180)

BLOCK_LINEAR = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def lora_model(base: str, **lora) -> torch.nn.Module:
    """ddpkit's model of the Hugging Face directory ``base`` with an adapter (``lora``: LoraConfig's keys)."""
    torch.manual_seed(0)
    config = ModelConfig(name="gpt", kwargs={"init_from": base}, lora=LoraConfig(**{"r": 4, "alpha": 8, **lora}))
    return apply_lora(gpt(init_from=base), config).eval()


def trained(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` as if trained: every adapter's B moved off zero (B starts at zero: the adapter would be a no-op)."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoraLinear):
                module.lora_B.weight.normal_(0, 0.05)
    return model


def test_the_base_is_frozen_and_the_adapter_starts_as_a_no_op(tmp_path):
    save_tiny(tmp_path, "qwen2")
    base = gpt(init_from=str(tmp_path)).eval()
    model = lora_model(str(tmp_path), targets=["q_proj", "v_proj"])
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    assert {name.split(".")[3] for name in trainable} == {"q_proj", "v_proj"}
    x = tokens(20)
    with torch.no_grad():
        assert torch.equal(model(x), base(x))
    state = model.state_dict()
    assert set(state) == set(trainable) | {"lora_base._extra_state"}
    assert state["lora_base._extra_state"]["targets"] == ["q_proj", "v_proj"]


def test_a_pipeline_ranks_stages_save_the_adapter_alone_and_the_bases_fingerprint():
    from ddpkit.models.lora import adapter_only_parts
    from ddpkit.parallel.pipeline_split import HeldParts, split_model

    torch.manual_seed(0)
    config = ModelConfig(name="gpt", lora=LoraConfig(r=2, alpha=4, targets="all-linear"))
    model = apply_lora(gpt(vocab_size=40, dim=16, depth=2, heads=2, max_len=8), config)
    stages = split_model(model, stages=2)
    whole = model.state_dict()
    held = [adapter_only_parts(HeldParts([stage]), model) for stage in stages]
    states = [part.state_dict() for part in held]
    # Each stage: its own adapter tensors and the fingerprint, nothing frozen; together, the whole model's state
    assert all(set(state) - {"lora_base._extra_state"} for state in states)
    assert all(".lora_" in k for state in states for k in state if k != "lora_base._extra_state")
    assert {k for state in states for k in state} == set(whole)
    assert all(state["lora_base._extra_state"] == whole["lora_base._extra_state"] for state in states)
    # A stage's checkpoint loads back (the frozen base is not missing), and refuses another base's adapter
    held[1].load_state_dict(states[1])
    other = {**states[1], "lora_base._extra_state": {**states[1]["lora_base._extra_state"], "fingerprint": "0" * 64}}
    with pytest.raises(CheckpointError, match="LoRA adapter was trained on the base"):
        held[1].load_state_dict(other)


def test_targets_follow_peft_and_unknown_names_are_refused(tmp_path):
    model = gpt(arch="llama", dim=32, depth=2, heads=4, kv_heads=2, tied=False)
    everything = lora_targets(model, "all-linear")
    assert len(everything) == 14 and {n.rsplit(".", 1)[-1] for n in everything} == BLOCK_LINEAR  # not head
    assert lora_targets(model, ["attn.q_proj"]) == ["blocks.0.attn.q_proj", "blocks.1.attn.q_proj"]
    with pytest.raises(ConfigError, match=r"'qproj' names no module of the model; its linear layers are down_proj"):
        lora_targets(model, ["qproj"])
    with pytest.raises(ConfigError, match=r"'attn' names blocks.0.attn, a LlamaAttention, not an nn.Linear"):
        lora_targets(model, ["attn"])
    with pytest.raises(ConfigError, match=r"model.lora.dropout: expected a probability in \[0, 1\)"):
        apply_lora(model, ModelConfig(name="gpt", lora=LoraConfig(dropout=1.0)))


def test_the_adapter_alone_loads_onto_its_base_and_another_base_is_refused_naming_both(tmp_path):
    save_tiny(tmp_path / "a", "llama")
    model = trained(lora_model(str(tmp_path / "a")))
    state = model.state_dict()
    again = lora_model(str(tmp_path / "a"))
    again.load_state_dict(state)
    with torch.no_grad():
        assert torch.equal(again(tokens(20)), model(tokens(20)))
    save_tiny(tmp_path / "b", "llama", initializer_range=0.03)
    other = lora_model(str(tmp_path / "b"))
    with pytest.raises(
        CheckpointError, match=rf"trained on the base {tmp_path / 'a'} \(sha256 of its source [0-9a-f]{{16}}\)"
    ):
        other.load_state_dict(state)
    with pytest.raises(CheckpointError, match=rf"but this run's base is {tmp_path / 'b'} \(sha256 of its source"):
        other.load_state_dict(state)
    with pytest.raises(CheckpointError, match=r"this run's model.lora is \{'r': 8"):
        lora_model(str(tmp_path / "a"), r=8).load_state_dict(state)


def test_merging_in_fp32_gives_the_adapters_logits(tmp_path):
    save_tiny(tmp_path, "qwen3")
    model = trained(lora_model(str(tmp_path)))
    x = tokens(20)
    with torch.no_grad():
        before = model(x)
        merged = merge_lora(model)
        assert not any(isinstance(m, LoraLinear) for m in merged.modules())
        assert "lora_base._extra_state" not in merged.state_dict() and "embed.weight" in merged.state_dict()
        torch.testing.assert_close(merged(x), before, atol=1e-5, rtol=0)


def _lora_run_directory(tmp_path, family: str) -> tuple[torch.nn.Module, str]:
    """A tiny ``family`` model in tmp_path/hf, and a run directory holding a "trained" adapter on it."""
    save_tiny(tmp_path / "hf", family)
    model = trained(lora_model(str(tmp_path / "hf"), targets="all-linear"))
    run = tmp_path / "run"
    run.mkdir()
    torch.save(model.state_dict(), run / "model.pt")
    (run / "config.yaml").write_text(
        f"model: {{name: gpt, kwargs: {{init_from: {tmp_path / 'hf'}}}, "
        "lora: {r: 4, alpha: 8, dropout: 0.0, targets: all-linear}}\n"
    )
    return model, str(run)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_peft_loads_the_exported_adapter_onto_the_transformers_model_to_ddpkits_logits(tmp_path, family):
    model, run = _lora_run_directory(tmp_path, family)
    line = export_peft(run, tmp_path / "adapter")
    assert "adapter_config.json + adapter_model.safetensors (28 tensors, r=4 on down_proj, gate_proj" in line
    config = json.loads((tmp_path / "adapter/adapter_config.json").read_text())
    assert config["modules_to_save"] is None and config["lora_alpha"] == 8
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    x = tokens(24)
    with torch.no_grad():
        torch.testing.assert_close(adapted(x).logits, model(x), atol=1e-4, rtol=0)


def test_the_merged_export_is_a_plain_directory_with_the_adapters_logits(tmp_path):
    model, run = _lora_run_directory(tmp_path, "llama")
    with pytest.raises(CheckpointError, match=r"trained a LoRA adapter .*--format hf --merge.*--format peft"):
        export_hf(run, tmp_path / "out")
    line = export_hf(run, tmp_path / "out", merge=True)
    assert "(LoRA merged in fp32) from" in line
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    x = tokens(24)
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, model(x), atol=1e-4, rtol=0)
    generated, _ = load_model(run)
    with torch.no_grad():
        assert torch.equal(generated(x), model(x))


def test_a_lora_run_checkpoints_the_adapter_resumes_bitwise_and_refuses_a_changed_base(tmp_path):
    reference = save_tiny(tmp_path / "hf", "llama")
    data = token_files(tmp_path / "data")
    whole = fit(lora_run(str(tmp_path / "hf"), str(tmp_path / "whole"), data, steps=4))
    fit(lora_run(str(tmp_path / "hf"), str(tmp_path / "half"), data, steps=2))
    resumed = fit(lora_run(str(tmp_path / "hf"), str(tmp_path / "half"), data, steps=4))
    assert resumed["train_loss"] == whole["train_loss"]
    a = torch.load(tmp_path / "whole/model.pt", weights_only=True)
    b = torch.load(tmp_path / "half/model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if k != "lora_base._extra_state")
    checkpoint = torch.load(sorted((tmp_path / "whole/checkpoints").glob("*.pt"))[-1], weights_only=True)
    adapter = [k for k in checkpoint["model"] if k != "lora_base._extra_state"]
    assert all(".lora_" in k for k in adapter) and len(adapter) == 28
    assert len(checkpoint["optimizer"]["state"]) == 28  # AdamW's moments: the adapter's only
    # the base did not move: the model rebuilt from the run equals transformers' base plus the adapter
    model, _ = load_model(tmp_path / "whole")
    assert torch.equal(merge_lora(model).embed.weight, reference.model.embed_tokens.weight)
    save_tiny(tmp_path / "hf", "llama", initializer_range=0.03)  # the same directory, other weights
    with pytest.raises(CheckpointError, match=r"LoRA adapter was trained on the base .*hf \(sha256 of its source"):
        fit(lora_run(str(tmp_path / "hf"), str(tmp_path / "half"), data, steps=6))


class HuggingFaceLoRA(ddpkit.Trainer):
    """A transformers model through the generic path: its own build_model and steps, model.lora through peft."""

    def build_model(self) -> torch.nn.Module:
        return transformers.AutoModelForCausalLM.from_pretrained(self.config.model.kwargs["pretrained"])

    def training_step(self, batch):
        x, y = batch
        logits = self.model(input_ids=x).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())

    def validation_step(self, batch):
        x, y = batch
        logits = self.model(input_ids=x).logits
        return {"loss": torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")}


def test_a_hugging_face_model_gets_its_adapter_from_peft_and_exports_it(tmp_path):
    save_tiny(tmp_path / "hf", "qwen2")
    config = lora_run(str(tmp_path / "hf"), str(tmp_path / "run"), token_files(tmp_path / "data"), steps=2)
    config["model"] = {"kwargs": {"pretrained": str(tmp_path / "hf")}, "lora": {"r": 4, "targets": ["q_proj"]}}
    trainer = HuggingFaceLoRA(config)
    trainer.fit()
    assert isinstance(trainer.unwrapped_model, peft.PeftModel)
    saved = torch.load(tmp_path / "run/model.pt", weights_only=True)
    assert sorted(saved)[0] == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert len(saved) == 5  # 2 blocks x (A, B), and the base's fingerprint
    export_peft(tmp_path / "run", tmp_path / "adapter")
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    x = tokens(16)
    with torch.no_grad():
        torch.testing.assert_close(
            adapted(x).logits, trainer.unwrapped_model.eval()(input_ids=x).logits, atol=1e-5, rtol=0
        )


def _adapter(run) -> dict[str, torch.Tensor]:
    saved = torch.load(run / "model.pt", weights_only=True)
    return {key: value for key, value in saved.items() if key != "lora_base._extra_state"}


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_ranks_equal_one_under_ddp_zero1_and_fsdp2(tmp_path):
    from helpers import run_in_pool

    save_tiny(tmp_path / "hf", "qwen3")
    data = token_files(tmp_path / "data")
    fit(lora_run(str(tmp_path / "hf"), str(tmp_path / "one"), data))
    one = _adapter(tmp_path / "one")
    for mode in ("ddp", "zero1", "fsdp2"):
        config = lora_run(str(tmp_path / "hf"), str(tmp_path / mode), data, mode=mode)
        run_in_pool(fit, 2, args=(config,), timeout=240)
        two = _adapter(tmp_path / mode)
        assert two.keys() == one.keys(), mode
        for key in one:
            # Two ranks sum the batch's gradients in another order; AdamW's normalisation turns the rounding of a
            # near-zero gradient into a step. Measured 1.16e-6 at most (o_proj's lora_A under ddp) since the base
            # model draws its weights by name, which moved the adapters' draw from torch's generator.
            torch.testing.assert_close(two[key], one[key], atol=2e-6, rtol=0, msg=f"{mode}: {key}")
        if mode == "fsdp2":
            checkpoint = next((tmp_path / mode / "checkpoints").glob("step-*.dcp"))
            export_peft(checkpoint, tmp_path / "adapter")  # the adapter from the sharded checkpoint
            assert len(json.loads((tmp_path / "adapter/adapter_config.json").read_text())["target_modules"]) == 7


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_sigkilled_lora_run_resumes_bitwise(tmp_path):
    """`ddpkit run`'s own restart (`--max-restarts 1`) after rank 1 SIGKILLs itself is what brings the adapter back from
    the checkpoint."""
    import yaml
    from helpers import run_cli

    save_tiny(tmp_path / "hf", "llama")
    data = token_files(tmp_path / "data")
    runs = {}
    for name, env in (("clean", {}), ("killed", {"KILL_RANK": "1", "KILL_AT_STEP": "3"})):
        lora = {"lora": {"r": 4, "dropout": 0.1, "targets": "all-linear"}}
        config = lora_run(str(tmp_path / "hf"), str(tmp_path / name), data, steps=6, model=lora)
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(config))
        done = run_cli(
            "run",
            str(tmp_path / f"{name}.yaml"),
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--script",
            "tests/scripts/mixture_trainer.py",
            env=env,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        runs[name] = _adapter(tmp_path / name)
    # the killed run did restart: its ranks logged steps of a second attempt (mixture_trainer.py's lines)
    assert any(line.startswith("1 ") for line in (tmp_path / "killed/windows-rank0.txt").read_text().splitlines())
    assert runs["clean"].keys() == runs["killed"].keys()
    assert all(torch.equal(runs["clean"][k], runs["killed"][k]) for k in runs["clean"])


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_under_a_pipeline_the_base_stays_frozen_and_the_adapter_exports(tmp_path):
    from helpers import run_in_pool
    from torch.distributed.checkpoint import FileSystemReader

    reference = save_tiny(tmp_path / "hf", "llama")  # a tied head: the last stage holds the embedding too
    config = lora_run(str(tmp_path / "hf"), str(tmp_path / "run"), token_files(tmp_path / "data"))
    config["parallel"] = {"pipeline": 2}
    run_in_pool(fit, 2, args=(config,), timeout=240)
    # Adapter-only, as in every other layout: model.pt and the sharded checkpoint hold no frozen tensor
    saved = torch.load(tmp_path / "run/model.pt", weights_only=True)
    adapter = [k for k in saved if k != "lora_base._extra_state"]
    assert all(".lora_" in k for k in adapter) and len(adapter) == 28 and "lora_base._extra_state" in saved
    newest = sorted((tmp_path / "run/checkpoints").glob("*.dcp"))[-1]
    stored = FileSystemReader(str(newest)).read_metadata().state_dict_metadata
    assert {k.split(".", 1)[0] for k in stored} == {"model", "optimizer"}
    assert all(".lora_" in k for k in stored) and sum(k.startswith("model.") for k in stored) == 28
    # It resumes: every stage's adapter and optimizer from the adapter-only shards, the base rebuilt
    config["train"]["max_steps"] = 6
    assert [metrics["step"] for metrics in run_in_pool(fit, 2, args=(config,), timeout=240)] == [6, 6]
    records = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train_loss" in r] == [1, 2, 3, 4, 5, 6]  # steps 5, 6 after the resume
    export_peft(tmp_path / "run", tmp_path / "adapter")
    export_hf(tmp_path / "run", tmp_path / "merged", merge=True)
    model, _ = load_model(tmp_path / "run")
    adapted = peft.PeftModel.from_pretrained(reference, tmp_path / "adapter").eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    x = tokens(16)
    with torch.no_grad():
        torch.testing.assert_close(adapted(x).logits, model(x), atol=1e-4, rtol=0)
        torch.testing.assert_close(merged(x).logits, model(x), atol=1e-4, rtol=0)
