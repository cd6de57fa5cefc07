r"""A Trainer that logs every step it trains, per rank, and can SIGKILL itself: for tests/test_goodput.py.

    KILL_RANKS=1 KILL_AT_STEP=7 ddpkit run CONFIG --nproc-per-node 2 --max-restarts 2 \
        --script tests/scripts/goodput_trainer.py
    KILL_RANKS=all KILL_AT_STEP=13 ...      # every worker dies at once (a lost host)

Each rank appends ``attempt step fingerprint`` to ``<output_dir>/trained-rank<r>.log`` after each
optimizer step (the fingerprint is the sum of the step's input batch, so the sample order before
and after a restart can be compared). The kill happens on the first attempt only
(``TORCHELASTIC_RESTART_COUNT=0``), right after step ``KILL_AT_STEP`` completed on every rank.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

import ddpkit
from ddpkit.checkpoint import files, memory_tier

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
KILL_RANKS = os.environ.get("KILL_RANKS", "")
KILL_AT_STEP = int(os.environ.get("KILL_AT_STEP", "-1"))


class LoggingTrainer(ddpkit.Trainer):
    _fingerprint = 0.0

    def training_step(self, batch: Any) -> torch.Tensor:
        self._fingerprint += float(batch[0].sum())
        return super().training_step(batch)

    def on_step_end(self, step: int) -> None:
        with open(Path(self.config.output_dir) / f"trained-rank{self.rank}.log", "a") as f:
            f.write(f"{ATTEMPT} {step} {self._fingerprint!r}\n")
        self._fingerprint = 0.0
        doomed = KILL_RANKS == "all" or str(self.rank) in KILL_RANKS.split(",")
        if ATTEMPT == 0 and doomed and step == KILL_AT_STEP:
            self._wait_for_the_last_snapshot(step)
            os.kill(os.getpid(), signal.SIGKILL)

    def _wait_for_the_last_snapshot(self, step: int) -> None:
        """The host in this test is lost after its last memory snapshot landed. Rank 0 writes snapshots in a
        background thread; on a loaded machine one could still be in flight at the kill, and the run would then
        resume (rightly) from the older disk checkpoint, which is not the case under test."""
        every = self.config.checkpoint.memory_every_steps
        if not isinstance(every, int) or every <= 0:
            return
        landed = step - step % every
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            newest = files.find_latest_checkpoint(memory_tier.snapshot_dir(self.config))
            if newest is not None and newest.step >= landed:
                return
            time.sleep(0.05)


if __name__ == "__main__":
    LoggingTrainer.main()
