"""A Trainer whose rank 0 pauses after step ``$PAUSE_AT_STEP`` (up to 120 s, or until ``$PAUSE_DIR/go``).

    PAUSE_AT_STEP=50 PAUSE_DIR=/tmp/p ddpkit run CONFIG --nproc-per-node 2 --script tests/scripts/paused_trainer.py

It writes ``$PAUSE_DIR/paused`` when the pause begins, so a test can act on a job that is really mid-run
(tests/test_storage_e2e.py: kill every process once the bucket holds the checkpoint saved before the pause).
"""

import os
import time
from pathlib import Path

import ddpkit


class Paused(ddpkit.Trainer):
    def on_step_end(self, step):
        if self.rank == 0 and step == int(os.environ.get("PAUSE_AT_STEP", "0")):
            pause = Path(os.environ["PAUSE_DIR"])
            (pause / "paused").touch()
            deadline = time.monotonic() + 120
            while not (pause / "go").exists() and time.monotonic() < deadline:
                time.sleep(0.05)


if __name__ == "__main__":
    Paused.main()
