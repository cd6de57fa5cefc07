"""The process torch's launcher starts for a benchmark: ``python -m ddpkit.bench.worker SPEC.json``.

The spec (written by :func:`ddpkit.bench.launching.run_workers`) names the benchmark ``kind``,
its parameters and where rank 0 writes the result. A kind is a function
``worker(params, *, runtime, workdir) -> dict``: for the built-in benchmarks, the ``worker`` of
the module :mod:`ddpkit.bench.<kind>`; benchmark scripts pass their own to :func:`serve`. The
process group is created once here and reused by everything the benchmark runs (several Trainer
runs in a row, for ``autotune``).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ddpkit.atomic import write_atomically
from ddpkit.distributed.env import read_dist_env
from ddpkit.distributed.process_group import process_group
from ddpkit.launch.entrypoint import run_entrypoint

__all__ = ["main", "serve"]

KINDS = ("throughput", "allreduce", "autotune", "scaling")


def serve(spec_path: str | os.PathLike, workers: Mapping[str, Callable[..., dict[str, Any]]]) -> int:
    """Run the worker the spec names on this rank inside one process group; return the exit code."""
    spec = json.loads(Path(spec_path).read_text())
    if spec["kind"] not in workers:
        print(
            f"benchmark worker: unknown kind {spec['kind']!r}; this program serves {', '.join(workers)}",
            file=sys.stderr,
        )
        return 2

    def job() -> None:
        env = read_dist_env()
        with process_group(env, timeout=spec["params"].get("timeout", 300)) as runtime:
            result = workers[spec["kind"]](spec["params"], runtime=runtime, workdir=Path(spec["workdir"]))
        if env.rank == 0:
            write_atomically(spec["result"], json.dumps(result))

    return run_entrypoint(job)


def main(argv: list[str] | None = None) -> int:
    """Serve the built-in benchmarks (:data:`KINDS`) for the spec file ``argv[0]``."""
    argv = sys.argv[1:] if argv is None else argv
    kind = json.loads(Path(argv[0]).read_text())["kind"]
    workers = {kind: importlib.import_module(f"ddpkit.bench.{kind}").worker} if kind in KINDS else {}
    return serve(argv[0], workers)


if __name__ == "__main__":
    sys.exit(main())
