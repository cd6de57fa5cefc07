"""Run a benchmark worker on N processes through torch's launcher and collect its result.

    result = run_workers("allreduce", {"sizes": [1024, 2048]}, nproc=2)

The driver writes the job's parameters to ``spec.json`` in a temporary directory and starts
``torchrun --standalone --nproc-per-node=N -m ddpkit.bench.worker spec.json`` with
:func:`ddpkit.launch.launcher.launch` (``torch.distributed.run`` in this process, a free port each time).
Rank 0 of the workers writes ``result.json`` next to the spec; the driver reads it back.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ddpkit.errors import DdpkitError

__all__ = ["run_workers", "BenchFailed"]


class BenchFailed(DdpkitError):
    """The benchmark's worker processes failed (their output above says why)."""


def run_workers(
    kind: str, params: dict[str, Any], *, nproc: int, threads: int | None = 1, entry: list[str] | None = None
) -> dict[str, Any]:
    """Run worker ``kind`` (see :mod:`ddpkit.bench.worker`) on ``nproc`` local processes; return rank 0's result.

    ``threads`` sets ``OMP_NUM_THREADS`` for the workers (one thread per rank by default, so N
    ranks on N cores neither oversubscribe nor leave the 1-rank run with extra cores); None keeps
    the caller's setting. ``entry`` replaces ``-m ddpkit.bench.worker`` with another program
    taking the spec path as its last argument (a benchmark script serving its own kinds with
    :func:`ddpkit.bench.worker.serve`).
    """
    from ddpkit.launch.launcher import launch, torchrun_argv

    with tempfile.TemporaryDirectory(prefix=f"ddpkit-bench-{kind}-") as tmp:
        spec = Path(tmp) / "spec.json"
        result = Path(tmp) / "result.json"
        spec.write_text(json.dumps({"kind": kind, "params": params, "result": str(result), "workdir": tmp}))
        argv = torchrun_argv(nproc=str(nproc), program=[*(entry or ["-m", "ddpkit.bench.worker"]), str(spec)])
        with _env(OMP_NUM_THREADS=str(threads) if threads else None):
            code = launch(argv)
        if code != 0 or not result.exists():
            raise BenchFailed(f"the {kind} benchmark on {nproc} process(es) failed; see the workers' output above")
        return json.loads(result.read_text())


@contextlib.contextmanager
def _env(**values: str | None) -> Iterator[None]:
    """Set environment variables (None leaves one as it is) and restore them afterwards."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update({name: value for name, value in values.items() if value is not None})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
