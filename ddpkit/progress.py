"""Where training is: the one counter the loop advances and every part of a run reads.

    progress = Progress()
    progress.step += 1                  # the loop, after each optimizer step
    progress.load_state_dict(saved)     # a resume: in place, so every holder sees the restored values

It sits at the bottom of the package (beside ``errors``) because the reporter, the watchdog, health,
the goodput ledger and the checkpointer all hold this same object: each can name its type without
importing the layer that advances it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Progress"]


@dataclass
class Progress:
    """Where training is: optimizer steps taken, current epoch, micro-batches consumed in it.

    ``batch_in_epoch`` counts this run's loader batches, whose size depends on the split of the global batch; a
    checkpoint also records the position in global samples (:mod:`ddpkit.data.position`), which any split finds.
    """

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore in place: the loop, the reporter and the watchdog all hold this same object."""
        step = int(state["step"])
        epoch = int(state["epoch"])
        batch_in_epoch = int(state["batch_in_epoch"])
        # All three read before any is set: a state that lacks one leaves the counter as it was.
        self.step = step
        self.epoch = epoch
        self.batch_in_epoch = batch_in_epoch
