"""The epoch loop of a stream: every rank yields the same number of batches, and resumes exactly.

    loader = ddpkit.data.streaming.build_stream_loader(stream, env=env, batch_size=64, accum=2, window_steps=8)
    epochs = loader.stream_epochs                 # a StreamEpochs
    epochs.start_epoch(epoch, start_batch=n)      # n > 0: continue a checkpointed epoch (after load_state_dict)
    for batch in epochs: ...                      # ends at the same batch on every rank
    state = epochs.state_dict()                   # the checkpoint's "data_position" (a collective)

Each rank reads ahead a window of ``window_steps`` optimizer steps and the ranks agree on the
window's length with ONE ``all_reduce(MIN)`` of one integer: when one rank's shard ends, every
rank ends the epoch at the same step, without a per-step collective. The batches left over
(less than a global step) and the partial batches the workers could not fill are dropped, and
counted in one log line per epoch. A checkpoint stores each rank's ``StatefulDataLoader`` state
at its current window's start; resuming restores it, re-reads the window and skips the batches
already trained on.
"""

from __future__ import annotations

import copy
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from ddpkit.data.uneven import group_device, grouped, uneven_stream_end
from ddpkit.distributed.collectives import all_gather_object
from ddpkit.errors import DataError

__all__ = ["StreamEpochs", "Tail"]

log = logging.getLogger("ddpkit")


@dataclass(frozen=True)
class Tail:
    """Sent by a worker whose share ended with ``samples`` that did not fill a batch (counted, dropped)."""

    samples: int


class StreamEpochs:
    """Iterates a stream loader one epoch at a time; every rank yields the same number of batches.

        epochs = stream_epochs_of(loader)                         # build_stream_loader(..., accum=2, window_steps=8)
        epochs.start_epoch(epoch, start_batch=batch_in_epoch)   # start_batch > 0: after load_state_dict
        for batch in epochs: ...                                  # ends on every rank at the same batch
        state = epochs.state_dict()                               # a checkpoint's "data position"

    ``batches_per_epoch`` is None until a whole epoch has been seen.
    """

    #: Batches per epoch as the Trainer's epoch protocol asks (ddpkit.data.epochs): not known ahead.
    length = None

    def __init__(self, loader: DataLoader, *, accum: int = 1, window_steps: int = 8, uneven: str = "error"):
        self.loader = loader
        self.accum = accum
        self.window_steps = window_steps
        self.uneven = uneven
        self.batches_per_epoch: int | None = None
        self.epoch = 0
        self._skip = 0
        self._window_first = 0
        self._window_state = None
        self._saved: dict[str, Any] | None = None

    @property
    def stream(self) -> Any:
        return self.loader.dataset  # type: ignore[return-value]

    @property
    def window(self) -> int:
        """Micro-batches per read-ahead window: whole optimizer steps, so no step straddles the stop."""
        return self.window_steps * self.accum

    def start_epoch(self, epoch: int, *, start_batch: int = 0) -> None:
        """Prepare ``epoch``; ``start_batch`` > 0 continues a checkpointed epoch after that many batches."""
        self.epoch = epoch
        self._skip = start_batch
        self._window_first = 0
        self._window_state = None
        self.stream.set_epoch(epoch)
        if self.loader.generator is not None:
            # worker seeds: a function of the epoch
            self.loader.generator.manual_seed(self.stream.seed * 1_000_003 + epoch)
        saved = self._saved
        self._saved = None
        if start_batch and saved is not None and saved.get("saved_ranks"):
            raise DataError(
                f"cannot resume the training stream at batch {start_batch} of "
                f"epoch {epoch} on {self.stream.world_size} ranks: "
                f"the checkpoint was written by {saved['saved_ranks']}, and a stream's position is per rank. Resume on "
                f"{saved['saved_ranks']} ranks, or from a checkpoint taken at an epoch's end (checkpoint.every_epochs)."
            )
        if start_batch and saved is not None and saved["epoch"] == epoch and saved["window_first"] <= start_batch:
            self._window_first = saved["window_first"]
            self._window_state = saved["loader"]
            self._skip = start_batch - saved["window_first"]
        if self._window_state is not None:
            self.loader.load_state_dict(self._window_state)
        elif start_batch:
            log.info("streaming: no saved stream position for epoch %d; replaying %d batches", epoch, start_batch)

    def state_dict(self) -> dict[str, Any]:
        """Every rank's window start (a collective: each rank's loader is at its own position).

        With the Trainer's batch count that is enough to resume exactly.
        """
        own = {
            "epoch": self.epoch,
            "window_first": self._window_first,
            "loader": self._window_state,
            "batches_per_epoch": self.batches_per_epoch,
        }
        return {"ranks": all_gather_object(own)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Remember this rank's position; the next ``start_epoch`` with its epoch resumes from it."""
        ranks = state.get("ranks") or []
        if len(ranks) == self.stream.world_size:
            self._saved = dict(ranks[self.stream.rank])
            self.batches_per_epoch = self._saved.get("batches_per_epoch")
        elif ranks:
            # Another world size: only a resume at an epoch's start can work.
            self._saved = {"epoch": None, "saved_ranks": len(ranks)}

    def agree_on_count(self, *, epoch: int, consumed: int, uneven: str) -> int:
        """Not known ahead: the ranks agree as they read (the epoch protocol of ddpkit.data.epochs)."""
        return sys.maxsize

    def batches(self, **_: Any) -> Iterator[Any]:
        """The epoch's batches; they end at the same batch on every rank."""
        return iter(self)

    def __iter__(self) -> Iterator[Any]:
        batches = iter(self.loader)
        done = self._window_first
        first = True
        while True:
            # The position after the last window's reads: where a resume re-reads from.
            if not first:
                self._window_first = done
                self._window_state = copy.deepcopy(self.loader.state_dict())
            window, tails = self._read(batches, self.window)
            agreed = self._agree(len(window))
            for batch in window[:agreed]:
                done += 1
                if self._skip:
                    self._skip -= 1
                    continue
                yield batch
            if agreed < self.window:
                self._end_epoch(done, left=len(window) - agreed, tails=tails, rest=batches)
                return
            first = False

    def _read(self, batches: Iterator[Any], count: int) -> tuple[list[Any], int]:
        """Up to ``count`` batches, and the samples of partial batches the workers dropped meanwhile."""
        window = []
        tails = 0
        while len(window) < count:
            item = next(batches, None)
            if item is None:
                break
            if isinstance(item, Tail):
                tails += item.samples
            else:
                window.append(item)
        return window, tails

    def _agree(self, count: int) -> int:
        """The smallest ``count`` over ranks, in whole optimizer steps: ONE all_reduce per window."""
        if grouped():
            box = torch.tensor([count], dtype=torch.int64, device=group_device())
            dist.all_reduce(box, op=dist.ReduceOp.MIN)
            count = int(box.item())
        return count - count % self.accum

    def _end_epoch(self, done: int, *, left: int, tails: int, rest: Iterator[Any]) -> None:
        """Learn the epoch length, count every rank's unused samples (reading at most one more window),
        and stop every rank if one still had a whole window unread (``data.uneven: error``)."""
        self.batches_per_epoch = done
        more, more_tails = self._read(rest, self.window)
        left += len(more)
        dropped = left * self.stream.batch_size + tails + more_tails
        reads = all_gather_object((done + left, len(more) == self.window, dropped))
        uneven_stream_end(
            [(count, unread) for count, unread, _ in reads], epoch=self.epoch, ended_at=done, uneven=self.uneven
        )
        dropped = sum(r[2] for r in reads)
        unread = any(r[1] for r in reads)
        used = done * self.stream.batch_size * len(reads)
        log.info(
            "streaming: epoch %d ended after %d batches per rank (%d samples used); dropped %s%d samples that could "
            "not fill a batch or a global step",
            self.epoch,
            done,
            used,
            "at least " if unread else "",
            dropped,
        )
        if not done:
            raise DataError(
                "the training stream yields no full batch on some rank in "
                f"epoch {self.epoch}; check the dataset and data.batch_size"
            )
