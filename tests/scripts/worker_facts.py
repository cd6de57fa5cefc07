"""A worker that writes what its process looks like from inside to $FACTS_DIR/rank<RANK>.json.

``tests/test_forked_launch.py`` runs it with ``ddpkit run --script`` forked from the launcher and as
a new interpreter, and compares: a forked worker must look like a fresh ``python -u SCRIPT``.
"""

import atexit
import json
import os
import signal
import sys
from pathlib import Path

PRELOADED = "torch" in sys.modules  # before this script imports anything itself

import torch  # noqa: E402

out, rank = Path(os.environ["FACTS_DIR"]), os.environ["RANK"]
facts = {
    "name": __name__,
    "argv": sys.argv[1:],
    "path0": sys.path[0],
    "threads": torch.get_num_threads(),
    "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
    "sigint_python": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
    "comm": Path("/proc/self/comm").read_text().strip(),
    "cmdline": [a.decode() for a in Path("/proc/self/cmdline").read_bytes().split(b"\0") if a],
    "preloaded": PRELOADED,
}
atexit.register(lambda: (out / f"exit{rank}").write_text("ran"))
(out / f"rank{rank}.json").write_text(json.dumps(facts))
