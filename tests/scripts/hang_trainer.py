"""A Trainer subclass that hangs (or is merely slow) on purpose, for tests/test_watchdog.py.

    HANG_WHERE=step HANG_RANK=1 HANG_STEP=3 HANG_STAMP=/tmp/stamp \
        ddpkit run CONFIG --nproc-per-node 2 --script tests/scripts/hang_trainer.py dist.hang_timeout=8

Environment variables (read once at start):

* ``HANG_WHERE``: where rank ``HANG_RANK`` (default 1) stops progressing at optimizer step
  ``HANG_STEP`` (1-based, default 3), as a deadlock would (waiting on an event nobody sets):
  ``step`` (training_step), ``data`` (the dataset's __getitem__, inside a DataLoader worker when
  data.num_workers > 0), ``validation`` (validation_step), ``hook`` (on_step_end), ``stop`` (the
  rank sends itself SIGSTOP in training_step: frozen, no heartbeat), ``frozen`` (on_step_end calls
  libc's ``sleep(600)`` through ``ctypes.PyDLL``, which keeps the GIL: every Python thread of the
  rank freezes with it, the watchdog's included), ``fail`` (training_step raises), or ``none``.
* ``SLOW=1``: long legitimate work that must not be taken for a hang, each longer than a small
  ``dist.hang_timeout``: a first step that keeps running new code for ``SLOW_SECONDS`` on every
  rank (a stand-in for torch.compile tracing), a first batch that takes as long on rank 1 (a cold
  file system), validation batches of ``SLOW_SECONDS / 4`` each on rank 1, and a checkpoint save
  on rank 0 that takes ``SLOW_SECONDS``.
* ``HANG_STAMP``: a file; ``time.time()`` is written there right before the hang.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from typing import Any

import torch
from torch.utils.data import Dataset

import ddpkit
from ddpkit.checkpoint import files as checkpoint

WHERE = os.environ.get("HANG_WHERE", "none")
HANG_RANK = int(os.environ.get("HANG_RANK", "1"))
HANG_STEP = int(os.environ.get("HANG_STEP", "3"))
STAMP = os.environ.get("HANG_STAMP")
SLOW = os.environ.get("SLOW") == "1"
SLOW_SECONDS = float(os.environ.get("SLOW_SECONDS", "15"))
RANK = int(os.environ.get("RANK", "0"))


def hang(where: str) -> None:
    """Record the moment, then block forever the way a deadlock does (no CPU, one stack)."""
    if STAMP and not os.path.exists(STAMP):
        with open(STAMP, "w") as f:
            f.write(repr(time.time()))
    if WHERE == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    if WHERE == "fail":
        raise RuntimeError(f"injected fault in {where} on rank {RANK}")
    threading.Event().wait()


def sleep_in_c_holding_the_gil() -> None:
    """A stuck extension call: libc's sleep through PyDLL, which does not release the GIL."""
    if STAMP and not os.path.exists(STAMP):
        with open(STAMP, "w") as f:
            f.write(repr(time.time()))
    ctypes.PyDLL(None).sleep(600)


def run_new_code(seconds: float) -> None:
    """Keep executing freshly built functions, as a compiler's tracing does (each runs ~50 ms)."""
    deadline, n = time.monotonic() + seconds, 0
    source = "def traced(clock):\n    start = clock()\n    while clock() - start < 0.05:\n        pass\n"
    while time.monotonic() < deadline:
        n += 1
        namespace: dict[str, Any] = {}
        exec(compile(source, f"<traced {n}>", "exec"), namespace)
        namespace["traced"](time.perf_counter)


class HangingDataset(Dataset):
    """On the hanging rank, item ``hang_after`` blocks; with SLOW, rank 1's first item is slow."""

    def __init__(self, dataset: Dataset, hang_after: int | None):
        self.dataset, self.hang_after, self.served = dataset, hang_after, 0

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        self.served += 1
        if self.hang_after is not None and self.served > self.hang_after:
            hang("__getitem__")
        if SLOW and RANK == 1 and self.served == 1:
            time.sleep(SLOW_SECONDS)  # a cold file system: blocked in I/O, no progress visible
        return self.dataset[index]


class HangTrainer(ddpkit.Trainer):
    def _hangs(self, where: str) -> bool:
        return where in (WHERE, "any") and self.rank == HANG_RANK

    def build_datasets(self) -> tuple[Dataset, Dataset | None]:
        train, val = super().build_datasets()
        hang_after = (HANG_STEP - 1) * self.config.data.batch_size if self._hangs("data") else None
        return HangingDataset(train, hang_after), val

    def training_step(self, batch: Any) -> torch.Tensor:
        if self.progress.step + 1 >= HANG_STEP and (self._hangs("step") or self._hangs("stop") or self._hangs("fail")):
            hang("training_step")
        if SLOW and self.progress.step == 0 and not getattr(self, "_compiled", False):
            self._compiled = True
            run_new_code(SLOW_SECONDS)
        return super().training_step(batch)

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        if self._hangs("validation"):
            hang("validation_step")
        if SLOW and self.rank == 1:
            time.sleep(SLOW_SECONDS / 4)
        return super().validation_step(batch)

    def on_step_end(self, step: int) -> None:
        if self._hangs("hook") and step >= HANG_STEP:
            hang("on_step_end")
        if self._hangs("frozen") and step == HANG_STEP:
            sleep_in_c_holding_the_gil()


if SLOW and RANK == 0:
    _save = checkpoint.save_checkpoint

    def _slow_save(*args: Any, **kwargs: Any) -> Any:
        time.sleep(SLOW_SECONDS)  # a big synchronous write
        return _save(*args, **kwargs)

    checkpoint.save_checkpoint = _slow_save


if __name__ == "__main__":
    HangTrainer.main()
