"""Tiny Hugging Face Llama-family models and a tokenizer, made here from configs: nothing is downloaded.

    from hf_tiny import save_tiny, write_tokenizer, tokens
    reference = save_tiny(tmp_path / "qwen3", "qwen3")       # a random Qwen3ForCausalLM, saved sharded, eval mode
    write_tokenizer(tmp_path / "qwen3")                       # tokenizer.json + tokenizer_config.json (ChatML)

``tests`` is on pytest's ``pythonpath`` (pyproject.toml), so tests import it as ``hf_tiny``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

#: The shape every family shares: 2 blocks, 4 query heads over 2 key/value heads (grouped), a vocabulary of 320.
SHAPE = dict(
    vocab_size=320,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
#: What makes each family itself: Llama 3's RoPE rule and biases everywhere; Qwen2.5's untied head and q/k/v biases
#: (its own); Qwen3's q/k norms and a head_dim that is not hidden/heads; Mistral without a window.
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        tie_word_embeddings=True,
        attention_bias=True,
        mlp_bias=True,
    ),
    "qwen2": dict(tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "qwen3": dict(tie_word_embeddings=True, head_dim=16, num_key_value_heads=1),
    "mistral": dict(tie_word_embeddings=False, sliding_window=None),
}
#: The tokenizer's specials: an end-of-text and ChatML's turn markers (SmolLM2's and Qwen's chat format).
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def config_of(family: str, **overrides: Any) -> Any:
    """The transformers config of a tiny model of ``family`` (llama, qwen2, qwen3, mistral)."""
    import transformers

    classes = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "mistral": transformers.MistralConfig,
    }
    return classes[family](**{**SHAPE, **FAMILIES[family], **overrides})


def save_tiny(directory: Path | str, family: str, *, shard: bool = True, **overrides: Any) -> torch.nn.Module:
    """A random tiny model of ``family`` saved to ``directory`` (sharded: an index), returned in eval mode."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config_of(family, **overrides)).eval()
    with torch.no_grad():
        # norms are one and biases zero at init: make them matter
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(directory, max_shard_size="40KB" if shard else "1GB")
    return model


def to_4x_layout(directory: Path | str) -> dict[str, Any]:
    """Rewrite ``directory/config.json`` as transformers 4.x wrote it: ``rope_theta``, ``rope_scaling`` at the top."""
    path = Path(directory) / "config.json"
    config = json.loads(path.read_text())
    rope = dict(config.pop("rope_parameters") or {})
    config["rope_theta"] = rope.pop("rope_theta")
    rule = rope.pop("rope_type", "default")
    config["rope_scaling"] = None if rule == "default" else {"type": rule, **rope}
    config["torch_dtype"] = config.pop("dtype", "float32")
    path.write_text(json.dumps(config, indent=2))
    return config


def write_tokenizer(directory: Path | str, *, vocab_size: int = 300) -> None:
    """A byte-level BPE ``tokenizer.json`` trained on a few lines, and a ``tokenizer_config.json`` with ChatML."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = ["def main():\n    return 0\n", "The capital of France is Paris.", "What is 2 + 2? It is 4."] * 20
    tok.train_from_iterator(corpus, trainer=trainer)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHATML,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def tokens(n: int = 20, vocab: int = SHAPE["vocab_size"], batch: int = 2) -> torch.Tensor:
    """Fixed random token ids ``[batch, n]``."""
    return torch.randint(0, vocab, (batch, n), generator=torch.Generator().manual_seed(1))


def fine_tune(directory: str, out: str, mode: str, train: dict[str, Any] | None = None) -> dict[str, float]:
    """Rank r of a multi-rank run: 3 steps of the model in the Hugging Face ``directory`` on the stdlib bytes
    (``train``: more of the ``train`` section)."""
    import ddpkit

    return ddpkit.Trainer(
        {
            "run": {"output_dir": out, "seed": 0},
            "log": {"progress_bar": False},
            "dist": {"timeout": 60},
            "model": {"name": "gpt", "kwargs": {"init_from": directory}},
            "data": {"name": "tokens", "batch_size": 4, "kwargs": {"corpus": "stdlib", "seq_len": 32}},
            "optim": {"name": "adamw", "lr": 1e-3, "weight_decay": 0.1},
            "parallel": {"mode": mode},
            "train": {"max_steps": 3, "eval_every": 100, **(train or {})},
            "checkpoint": {"every_steps": 3},
        }
    ).fit()


def token_files(directory: Path | str, *, vocab: int = 300, train: int = 8192, val: int = 512) -> dict[str, str]:
    """Random token files ``train.bin`` / ``val.bin`` (uint16) of ids below ``vocab``; ``data.kwargs`` naming them."""
    import numpy as np

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    generator = np.random.default_rng(0)
    for name, count in (("train", train), ("val", val)):
        generator.integers(0, vocab, count).astype(np.uint16).tofile(directory / f"{name}.bin")
    return {"path": str(directory / "train.bin"), "val_path": str(directory / "val.bin")}


def lora_run(
    base: str, out: str, data: dict[str, str], *, mode: str = "ddp", steps: int = 4, **sections: Any
) -> dict[str, Any]:
    """The config of a LoRA fine-tune of the Hugging Face directory ``base`` (``sections`` update its sections)."""
    config: dict[str, Any] = {
        "run": {"output_dir": out, "seed": 0},
        "log": {"progress_bar": False},
        "dist": {"timeout": 60},
        "model": {"name": "gpt", "kwargs": {"init_from": base}, "lora": {"r": 4, "alpha": 8, "targets": "all-linear"}},
        "data": {"name": "tokens", "global_batch_size": 8, "kwargs": {**data, "seq_len": 16}},
        "optim": {"name": "adamw", "lr": 1e-2, "weight_decay": 0.1},
        "parallel": {"mode": mode},
        "train": {"max_steps": steps, "eval_every": 1000, "log_every": 1},
        "checkpoint": {"every_steps": 2},
    }
    for name, values in sections.items():
        config[name] = {**config.get(name, {}), **values}
    return config


def fit(config: dict[str, Any]) -> dict[str, float]:
    """``Trainer(config).fit()`` on this rank (for ddpkit.testing.run_on_ranks)."""
    import ddpkit

    return ddpkit.Trainer(config).fit()
