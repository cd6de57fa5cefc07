"""A training script that crashes on purpose, for the checkpoint and restart tests.

    python tests/checkpoint_crash.py CONFIG [key=value ...]                       # trains normally
    CRASH_AT_SAVE=3 CRASH_POINT=mid-file python tests/checkpoint_crash.py ...      # SIGKILL inside a write
    KILL_RANK=1 KILL_AT_STEP=7 ddpkit run CONFIG --script tests/checkpoint_crash.py --max-restarts 2

CRASH_POINT (during the CRASH_AT_SAVE-th checkpoint save):
  mid-file         half-way through writing the data file
  before-rename    data file fully written and fsynced, not yet renamed into place
  before-manifest  data file in place, manifest not yet written

KILL_RANK / KILL_AT_STEP: that rank SIGKILLs itself after that optimizer step, on the first
attempt only (TORCHELASTIC_RESTART_COUNT=0), as a crashed machine would.
"""

from __future__ import annotations

import os
import signal

import ddpkit
import ddpkit.atomic as atomic
import ddpkit.checkpoint.files as ckpt


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def arm_checkpoint_crash(save_index: int, point: str) -> None:
    """Make the ``save_index``-th save (1-based) die at ``point``."""
    real_save, real_replace, real_write = ckpt.save_checkpoint, os.replace, atomic._HashingWriter.write
    state = {"saves": 0, "armed": False}

    def save(*args, **kwargs):
        state["saves"] += 1
        state["armed"] = state["saves"] == save_index
        return real_save(*args, **kwargs)

    def replace(src, dst):
        if state["armed"] and point == "before-rename" and str(dst).endswith(".pt"):
            die()
        if state["armed"] and point == "before-manifest" and str(dst).endswith(".json"):
            die()
        return real_replace(src, dst)

    def write(self, data):
        written = real_write(self, data)
        if state["armed"] and point == "mid-file" and self.size > 2048:
            self.flush()
            die()
        return written

    ckpt.save_checkpoint = save
    ckpt.os.replace = replace
    atomic._HashingWriter.write = write


class CrashingTrainer(ddpkit.Trainer):
    def on_step_end(self, step: int) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if (
            first_attempt
            and str(self.rank) == os.environ.get("KILL_RANK")
            and step == int(os.environ.get("KILL_AT_STEP", -1))
        ):
            die()


if __name__ == "__main__":
    if "CRASH_AT_SAVE" in os.environ:
        arm_checkpoint_crash(int(os.environ["CRASH_AT_SAVE"]), os.environ["CRASH_POINT"])
    CrashingTrainer.main()
