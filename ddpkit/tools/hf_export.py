"""``ddpkit export RUN_OR_CHECKPOINT OUT_DIR --format hf``: a ``gpt`` model as a Hugging Face GPT-2 directory.

    $ ddpkit export runs/ft out/gpt2-ft --format hf          # a run: its model.pt (else its newest checkpoint)
    $ ddpkit export runs/ft/checkpoints/step-400.dcp out/ft --format hf   # an fsdp2 checkpoint, shards joined
    >>> GPT2LMHeadModel.from_pretrained("out/gpt2-ft")       # the same logits as the ddpkit model

OUT_DIR gets ``config.json`` (``model_type: gpt2``; shape, ``activation_function`` and the real
vocabulary: a padded one is cut back to ``valid_vocab`` ids) and ``model.safetensors`` (the names
``GPT2LMHeadModel`` uses, ``Conv1D`` weights transposed back, the tied output layer stored once),
each written atomically. A directory ``init_from`` loaded comes back out equal, bit for bit.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ddpkit.atomic import write_atomically
from ddpkit.errors import CheckpointError
from ddpkit.tools.export import save_safetensors
from ddpkit.tools.lm_source import read_model
from ddpkit.training.gpt import gpt_kwargs
from ddpkit.training.hf_gpt2 import hf_config, to_hf

__all__ = ["export_hf"]


def export_hf(source: str | os.PathLike, output: str | os.PathLike) -> str:
    """Write the ``gpt`` model of ``source`` (a run directory or a checkpoint) as a GPT-2 directory; say what."""
    spec = read_model(source)
    if spec.name != "gpt":
        raise CheckpointError(
            f"{spec.source}: --format hf writes ddpkit's gpt model as GPT-2, but this run's model is "
            f"{spec.name!r}; export it as .safetensors or .pt instead"
        )
    kwargs = gpt_kwargs(**spec.kwargs)
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    tensors = to_hf(spec.weights, kwargs)
    save_safetensors(tensors, output / "model.safetensors", metadata={"source": spec.source})
    write_atomically(output / "config.json", json.dumps(hf_config(kwargs), indent=2) + "\n", durable=True)
    shape = f"GPT-2 {kwargs['depth']} x {kwargs['dim']}"
    return f"wrote {output}: config.json + model.safetensors ({len(tensors)} tensors, {shape}) from {spec.source}"
