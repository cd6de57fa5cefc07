"""A Hugging Face causal language model under ddpkit: built from a config (nothing downloaded),
dict batches, and a loss weighted by tokens over documents of different lengths.

    pip install 'ddpkit[transformers]'
    torchrun --nproc-per-node=2 examples/hf_causal_lm.py
    torchrun --nproc-per-node=2 examples/hf_causal_lm.py parallel.mode=fsdp2 train.max_steps=50
    python examples/hf_causal_lm.py                                   # a world of one
    torchrun --nproc-per-node=2 examples/hf_causal_lm.py model.kwargs.pretrained=models/gpt2   # fine-tune a local model

The data are the bytes of Python's standard library (``data.kwargs.corpus=stdlib``, see
docs/lm.md), cut into windows of random length and padded: padding carries the label -100, so
under ``train.loss_normalization: tokens`` every real token weighs the same, however the global
batch is split over ranks and micro-batches.

``model.kwargs.pretrained`` names a local directory of any Hugging Face causal LM (what
``save_pretrained`` writes: GPT-2, Llama, Qwen, ...), loaded with ``AutoModelForCausalLM`` and
``local_files_only=True``: nothing is downloaded, and a directory that is not a causal LM is refused
in one line. Its vocabulary must hold the byte ids (257) and its context ``SEQ_LEN`` tokens. For
ddpkit's own ``gpt`` a GPT-2 directory loads with ``model: {name: gpt, kwargs: {init_from: DIR}}``
instead (configs/finetune_gpt2.yaml), which ``ddpkit generate`` and ``ddpkit export --format hf`` then read.
"""

import sys

import torch
from torch.nn import functional as F

import ddpkit
from ddpkit.data.tokens import tokens as token_datasets

try:
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel
except ImportError:
    sys.exit("examples/hf_causal_lm.py needs transformers: pip install 'ddpkit[transformers]'")

SEQ_LEN = 64
DEFAULTS = [  # key=value overrides, as on a command line; a key you give replaces its default here
    "run.name=hf_causal_lm",
    "data.batch_size=8",
    "optim.name=adamw",
    "optim.lr=1e-3",
    "train.max_steps=30",
    "train.log_every=10",
    "train.loss_normalization=tokens",
    "train.clip_grad_norm=1.0",
    "checkpoint.every_steps=15",
]


class RaggedDocuments(torch.utils.data.Dataset):
    """Token windows cut to a length of 8..seq_len (fixed per index), as Hugging Face dict batches."""

    def __init__(self, windows: torch.utils.data.Dataset):
        self.windows = windows

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x, _ = self.windows[i]
        length = 8 + (i * 7919) % (len(x) - 7)  # deterministic, different lengths
        mask = torch.arange(len(x)) < length
        labels = torch.where(mask, x, -100)
        return {"input_ids": torch.where(mask, x, 0), "attention_mask": mask.long(), "labels": labels}


def pretrained(directory: str) -> torch.nn.Module:
    """A causal LM from a local Hugging Face directory, or one line saying why not."""
    try:
        return AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as exc:  # no such directory / no weights; a config that is not a causal LM
        first = str(exc).strip().splitlines()[0]
        raise ddpkit.errors.ConfigError(
            f"model.kwargs.pretrained: {directory} is not a local causal LM directory "
            f"(save_pretrained's config.json + weights): {first}"
        ) from None


class CausalLMTrainer(ddpkit.Trainer):
    def build_model(self) -> torch.nn.Module:
        if self.config.model.kwargs.get("pretrained"):
            return pretrained(self.config.model.kwargs["pretrained"])  # the same weights on every rank
        config = GPT2Config(vocab_size=257, n_positions=SEQ_LEN, n_embd=64, n_layer=2, n_head=2)
        return GPT2LMHeadModel(config)  # random initial weights, the same on every rank (ddpkit seeds first)

    def build_datasets(self):
        train, val = token_datasets(corpus="stdlib", seq_len=SEQ_LEN)
        return RaggedDocuments(train), RaggedDocuments(val) if val is not None else None

    def _shifted(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten()  # position t predicts token t + 1

    def training_step(self, batch):
        logits, labels = self._shifted(batch)
        loss_sum = F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum")
        return loss_sum, (labels != -100).sum()

    def validation_step(self, batch):
        logits, labels = self._shifted(batch)
        counted = labels != -100
        return {"loss": F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="none")[counted]}


if __name__ == "__main__":
    CausalLMTrainer.main(defaults=DEFAULTS)
