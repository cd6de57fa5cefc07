"""A Trainer that records which windows it trains on, for tests/test_mixture.py.

    ddpkit run CONFIG --nproc-per-node 2 --script tests/scripts/mixture_trainer.py

Every rank appends one line per micro-batch to ``<output_dir>/windows-rank<R>.txt``: ``attempt step id id ...``
where ``id`` is each window's first token (the tests write files whose windows start with a
unique id). ``KILL_RANK`` / ``KILL_AT_STEP``: that rank SIGKILLs itself after that optimizer step,
on the first attempt only (``TORCHELASTIC_RESTART_COUNT=0``), as a crashed machine would.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import torch

import ddpkit


class MixtureTrainer(ddpkit.Trainer):
    def training_step(self, batch: Any) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        x, _ = batch
        with open(Path(self.config.output_dir) / f"windows-rank{self.rank}.txt", "a") as f:
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            f.write(f"{attempt} {self.progress.step} {' '.join(map(str, x[:, 0].tolist()))}\n")
        return super().training_step(batch)

    def on_step_end(self, step: int) -> None:
        kill_rank, kill_step = os.environ.get("KILL_RANK"), os.environ.get("KILL_AT_STEP")
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if kill_rank is not None and int(kill_rank) == self.rank and int(kill_step) == step and first_attempt:
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    MixtureTrainer.main()
