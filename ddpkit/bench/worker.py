"""The process torch's launcher starts for a benchmark: ``python -m ddpkit.bench.worker SPEC.json``.

The spec (written by :func:`ddpkit.bench.launching.run_workers`) names the benchmark ``kind``
(a module of :mod:`ddpkit.bench` with a ``worker(params, *, runtime, workdir)`` function), its
parameters and where rank 0 writes the result. The process group is created once here and
reused by everything the benchmark runs (several Trainer runs in a row, for ``autotune``).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

from ddpkit.distributed import process_group
from ddpkit.entrypoint import run_entrypoint
from ddpkit.env import read_dist_env

__all__ = ["main"]

KINDS = ("throughput", "allreduce", "autotune")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark described by the spec file ``argv[0]``; return the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(argv[0]).read_text())
    if spec["kind"] not in KINDS:
        raise SystemExit(f"ddpkit.bench.worker: unknown benchmark kind {spec['kind']!r}")

    def job() -> None:
        env = read_dist_env()
        module = importlib.import_module(f"ddpkit.bench.{spec['kind']}")
        with process_group(env, timeout=spec["params"].get("timeout", 300)) as runtime:
            result = module.worker(spec["params"], runtime=runtime, workdir=Path(spec["workdir"]))
        if env.rank == 0:
            tmp = Path(spec["result"] + ".tmp")
            tmp.write_text(json.dumps(result))
            os.replace(tmp, spec["result"])

    return run_entrypoint(job)


if __name__ == "__main__":
    sys.exit(main())
