"""The YAML-driven Trainer, recording which threads are still alive at interpreter exit, for
tests/test_distributed_training.py.

    EXIT_THREADS_DIR=/tmp/threads ddpkit run CONFIG --nproc-per-node 2 --script tests/scripts/exit_threads_trainer.py

Each rank writes ``EXIT_THREADS_DIR/rank<R>.json``: ``{"python": [...], "os": [...]}``, the names of
its Python threads and of all its OS threads (as Linux knows them) other than the main one, taken
by the last atexit handler, right before interpreter shutdown. A thread alive then that takes the
GIL later (a daemon thread back from a store call, a Gloo worker freeing a Python-owned tensor)
is ended by pthread_exit, which C++ frames turn into std::terminate: SIGABRT after a finished run.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
from pathlib import Path

import ddpkit


def record_threads() -> None:
    python = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    tasks = [task for task in Path("/proc/self/task").iterdir() if task.name != str(os.getpid())]
    names = []
    for task in tasks:
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:
            pass  # ended meanwhile
    out = Path(os.environ["EXIT_THREADS_DIR"]) / f"rank{os.environ['RANK']}.json"
    out.write_text(json.dumps({"python": sorted(python), "os": sorted(names)}))


if __name__ == "__main__":
    atexit.register(record_threads)  # registered first, so it runs last
    ddpkit.Trainer.main()
