"""A Trainer that rank 0 pauses after step 3 until ``$GATE_DIR/go`` exists (tests/helpers.py's start_gated_run).

    GATE_DIR=/tmp/gate python -m ddpkit run CONFIG --nproc-per-node 2 --script tests/scripts/gated_trainer.py

At step 3 rank 0 writes ``$GATE_DIR/ready.json`` (its store's port and its pid) and waits up to 60 s,
so a test can look at, or write to, a job that is really running.
"""

import json
import os
import time
from pathlib import Path

import ddpkit


class Gated(ddpkit.Trainer):
    def on_step_end(self, step):
        gate = Path(os.environ["GATE_DIR"])
        if step == 3 and self.rank == 0:
            (gate / "ready.json").write_text(json.dumps({"port": int(os.environ["MASTER_PORT"]), "pid": os.getpid()}))
            deadline = time.monotonic() + 60
            while not (gate / "go").exists() and time.monotonic() < deadline:
                time.sleep(0.05)


if __name__ == "__main__":
    Gated.main()
