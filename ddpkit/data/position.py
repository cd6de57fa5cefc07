"""Where an epoch is, in samples: a position that any split of the same global batch finds again.

    split = Split.of_config(config, world_size=2)      # how this run splits its global batch (ddpkit.config.split)
    position = SamplePosition(progress, split)          # the checkpoint's "progress" part
    position.state_dict()          # {"step", "epoch", "batch_in_epoch", "sample_in_epoch"}
    position.load_state_dict(saved)                     # batch_in_epoch for *this* run's split

The loop counts loader batches (``Progress.batch_in_epoch``): each data-parallel replica takes one batch at a time,
``batches_per_step`` of them a step (the accumulation, or a pipeline's M microbatches). How many samples a batch
holds depends on the split: a pipeline of 4 microbatches of 4 and plain DDP on 2 ranks of 8 each train the same 16
samples a step, but after step k the first has consumed ``4k`` loader batches and the second ``k``. A checkpoint that
kept only the batch count therefore sent a resume under another split elsewhere in the epoch (4k batches of 8 is
step 4k of the second run, not step k). A checkpoint now records the global samples consumed in the epoch
(``sample_in_epoch``), which no world size, layout or split changes, and each run converts it to its own batches.

Checkpoints written before ``sample_in_epoch`` existed hold only ``batch_in_epoch``: :func:`upgraded` converts it with
the saved run's own split (read from the config it saved).
"""

from __future__ import annotations

import logging
from typing import Any

from ddpkit.config.split import Split
from ddpkit.progress import Progress

__all__ = ["SamplePosition", "upgraded"]

log = logging.getLogger("ddpkit")


class SamplePosition:
    """The run's ``Progress`` as a checkpoint part: its counters, and the epoch's position in global samples."""

    def __init__(self, progress: Progress, split: Split):
        self.progress = progress
        self.split = split

    @property
    def sample_in_epoch(self) -> int:
        """Global samples of the current epoch consumed so far (every replica's)."""
        return self.progress.batch_in_epoch * self.split.samples_per_batch

    def state_dict(self) -> dict[str, int]:
        return {**self.progress.state_dict(), "sample_in_epoch": self.sample_in_epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore the counters; the batch position is this run's batches up to the saved sample position."""
        if "sample_in_epoch" not in state:
            self.progress.load_state_dict(state)
            return
        saved = int(state["sample_in_epoch"])
        per_step = self.split.samples_per_step
        # A sampler resumes on a step boundary only; a position between two of this run's steps (a global batch that
        # changed under checkpoint.allow_config_change) goes back to the boundary before it.
        start = saved - saved % per_step
        if start != saved:
            log.warning(
                "the checkpoint stopped at sample %d of epoch %d, which is not a step boundary of this run "
                "(%d samples a step): this run goes on from sample %d, so samples %d..%d train again",
                saved,
                int(state["epoch"]),
                per_step,
                start,
                start,
                saved - 1,
            )
        self.progress.load_state_dict({**state, "batch_in_epoch": start // self.split.samples_per_batch})


def upgraded(progress: dict[str, Any], saved_split: Split) -> dict[str, Any]:
    """A checkpoint's ``progress`` with ``sample_in_epoch``: converted from its ``batch_in_epoch`` with the saved
    run's split when it predates the sample position."""
    if "sample_in_epoch" in progress:
        return progress
    return {**progress, "sample_in_epoch": int(progress["batch_in_epoch"]) * saved_split.samples_per_batch}
