"""The ``train.sample`` config section: text sampled from a language model while it trains.

    train:
      sample: {every_steps: 200, prompt: "def ", max_new_tokens: 64}   # null (the default): no samples

Behaviour lives in :mod:`ddpkit.training.samples`: the sample goes to the log, to
``<output_dir>/samples.jsonl`` and to TensorBoard's text tab (with ``log.tensorboard``), on rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddpkit.config.fields import option

__all__ = ["SampleConfig"]


@dataclass(frozen=True)
class SampleConfig:
    """Sample text from the model every `every_steps` optimizer steps, outside the timed steps."""

    every_steps: int = option(500, "Optimizer steps between samples.", ge=1)
    prompt: str = option("\n", "The text each sample continues.")
    max_new_tokens: int = option(64, "Tokens sampled at most (fewer at end-of-text or a full context).", ge=1)
    temperature: float = option(0.8, "Sampling temperature; 0: greedy (the likeliest token each time).", ge=0)
    top_k: int | None = option(200, "Sample among the k likeliest tokens. `null`: all of them.", ge=1)
    seed: int = option(0, "Seed of the sampling: the same model and seed give the same sample.")
    tokenizer: str | None = option(
        None,
        "A local `tokenizer.json` to encode the prompt and decode the sample. `null`: byte tokens (ddpkit tokenize's "
        "default; end-of-text 256).",
    )
