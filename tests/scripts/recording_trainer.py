"""The YAML-driven Trainer, recording every step: each rank of tests/scripts/spark_job.py and tests/test_engines_mpi.py.

    python tests/scripts/recording_trainer.py CONFIG [key=value ...]     # STEPS_DIR=DIR [KILL_STEP=K]

Each rank appends "pid step" to $STEPS_DIR/steps-rank<r>.txt after every optimizer step. With
KILL_STEP, rank 1 SIGKILLs itself after that step the first time ($STEPS_DIR/killed marks it):
the rank dies as an OOM kill would, without a word.
"""

import os
import signal
from pathlib import Path

import ddpkit

OUT = Path(os.environ["STEPS_DIR"])
KILL = int(os.environ.get("KILL_STEP", "0"))


class Recorded(ddpkit.Trainer):
    def on_step_end(self, step: int) -> None:
        with open(OUT / f"steps-rank{self.rank}.txt", "a") as f:
            f.write(f"{os.getpid()} {step}\n")
        if KILL and self.rank == 1 and step == KILL and not (OUT / "killed").exists():
            (OUT / "killed").write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    Recorded.main()
