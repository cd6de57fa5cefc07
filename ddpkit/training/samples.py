"""``train.sample``: text sampled from the model as it trains, so a run shows what it learned, not only a loss.

    train:
      sample: {every_steps: 200, prompt: "def ", max_new_tokens: 64}

    events.add(TrainingSamples.for_run(config, rank=rank, model=bare_model, outside=reporter.outside_training))

Every ``every_steps`` optimizer steps the model continues the
prompt (:func:`ddpkit.models.generation.generate`, with ddpkit's ``gpt``'s KV cache) in eval mode and
without gradients, then goes back to training. Rank 0 writes the sample to the log, as a line of
``<output_dir>/samples.jsonl`` (``{"step", "prompt", "text"}``) and, with ``log.tensorboard``, to
TensorBoard's text tab under ``samples``. Every rank samples the same tokens (the same seed): under
fsdp2 each forward is a collective, and under ddp the ranks stay in step. The time is reported
outside the training steps (``outside``: the reporter's ``outside_training``), so samples/s and MFU
are not lowered by it.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

from ddpkit.config.sample_section import SampleConfig
from ddpkit.config.schema import Config
from ddpkit.data.text_codec import TextCodec
from ddpkit.models.generation import check_prompt, generate

__all__ = ["TrainingSamples", "SAMPLES_FILE"]

log = logging.getLogger(__name__)

#: One JSON line per sample, in the run's output directory.
SAMPLES_FILE = "samples.jsonl"


class TrainingSamples:
    """The listener of ``train.sample`` (see the module docstring)."""

    def __init__(
        self,
        section: SampleConfig,
        *,
        model: torch.nn.Module,
        output_dir: Path,
        rank: int,
        tensorboard: bool,
        outside: Callable[[str], AbstractContextManager[Any]],
    ):
        self.section = section
        self.model = model
        self.rank = rank
        self._outside = outside
        self.codec = TextCodec.open(section.tokenizer, option="train.sample.tokenizer")
        self.codec.check_fits(getattr(model, "valid_vocab", None) or model.vocab_size, option="train.sample.tokenizer")
        self.prompt_ids = self.codec.encode(section.prompt)
        check_prompt(model, self.prompt_ids, what="train.sample.prompt")
        self.path = output_dir / SAMPLES_FILE
        self._tensorboard_dir = output_dir / "tensorboard" if tensorboard and rank == 0 else None
        self._writer: Any = None
        self._last_step = -1

    @classmethod
    def for_run(
        cls, config: Config, *, rank: int, model: torch.nn.Module, outside: Callable[[str], AbstractContextManager[Any]]
    ) -> TrainingSamples | None:
        """The listener ``config.train.sample`` asks for, or None when it is null. ``model``: the bare model."""
        section = config.train.sample
        if section is None:
            return None
        return cls(
            section,
            model=model,
            output_dir=Path(config.output_dir),
            rank=rank,
            tensorboard=config.log.tensorboard,
            outside=outside,
        )

    def sample(self) -> str:
        """One sample's text (the prompt not included), on this rank."""
        was_training = self.model.training
        self.model.eval()
        try:
            with _in_its_narrowest_dtype(self.model):
                tokens = self._tokens()
        finally:
            self.model.train(was_training)
        return self.codec.decode(tokens)

    def _tokens(self) -> list[int]:
        return list(
            generate(
                self.model,
                self.prompt_ids,
                max_new_tokens=self.section.max_new_tokens,
                temperature=self.section.temperature,
                top_k=self.section.top_k,
                eot=self.codec.eot,
                seed=self.section.seed,
            )
        )

    def write(self, step: int, text: str) -> None:
        """Rank 0: the log line, ``samples.jsonl`` and TensorBoard's text tab."""
        if self.rank != 0:
            return
        log.info("sample at step %d: %r", step, self.section.prompt + text)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, "prompt": self.section.prompt, "text": text}, ensure_ascii=False) + "\n")
        if self._tensorboard_dir is not None:
            if self._writer is None:
                # log.tensorboard already needs it.
                from torch.utils.tensorboard import SummaryWriter

                self._writer = SummaryWriter(log_dir=str(self._tensorboard_dir))
            self._writer.add_text("samples", f"    {self.section.prompt + text}".replace("\n", "\n    "), step)
            self._writer.flush()

    def _sample_at(self, step: int) -> None:
        if step == self._last_step:
            return
        self._last_step = step
        with self._outside("sample"):
            self.write(step, self.sample())

    # --- listener methods (ddpkit.reporting.events) ---------------------------------------------

    def on_step_end(self, step: int) -> None:
        if step % self.section.every_steps == 0:
            self._sample_at(step)

    def on_exit(self, status: str) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _in_its_narrowest_dtype(model: torch.nn.Module) -> AbstractContextManager[Any]:
    """Autocast to the narrowest of the model's parameter dtypes when it stores two (LoRA's bf16 base beside its
    fp32 adapter under ``train.precision: bf16``: the matrix products need one dtype); nothing otherwise, so a model
    of one dtype samples as it always did."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if len(dtypes) < 2:
        return contextlib.nullcontext()
    narrowest = min(dtypes, key=lambda dtype: torch.finfo(dtype).bits)
    return torch.autocast(next(model.parameters()).device.type, dtype=narrowest)
