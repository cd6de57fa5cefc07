"""The YAML-driven Trainer, recording every step: each rank of tests/scripts/spark_job.py and tests/test_engines_mpi.py.

    python tests/scripts/recording_trainer.py CONFIG [key=value ...]     # STEPS_DIR=DIR [KILL_STEP=K]

Each rank appends "pid step" to $STEPS_DIR/steps-rank<r>.txt after every optimizer step. With
KILL_STEP, rank 1 SIGKILLs itself after that step the first time ($STEPS_DIR/killed marks it):
the rank dies as an OOM kill would, without a word. With KILL_WHOM=parent it SIGKILLs its parent instead.
"""

import os
import signal
from pathlib import Path

import ddpkit

OUT = Path(os.environ["STEPS_DIR"])
KILL = int(os.environ.get("KILL_STEP", "0"))
# "parent": kill the process that started this rank instead (under Spark: the task's Python worker, a lost task)
KILL_WHOM = os.environ.get("KILL_WHOM", "self")


class Recorded(ddpkit.Trainer):
    def on_step_end(self, step: int) -> None:
        with open(OUT / f"steps-rank{self.rank}.txt", "a") as f:
            f.write(f"{os.getpid()} {step}\n")
        if KILL and self.rank == 1 and step == KILL and not (OUT / "killed").exists():
            victim = os.getppid() if KILL_WHOM == "parent" else os.getpid()
            (OUT / "killed").write_text(str(victim))
            os.kill(victim, signal.SIGKILL)


if __name__ == "__main__":
    Recorded.main()
