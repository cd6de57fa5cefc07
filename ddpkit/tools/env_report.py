"""``ddpkit env``: what to paste into a bug report, as ``python -m torch.utils.collect_env`` or ``accelerate env``.

    $ ddpkit env            # aligned text
    $ ddpkit env --json     # the same as one JSON object on stdout

It reports ddpkit's and torch's versions; CUDA, cuDNN, NCCL and Gloo (available, version); the
GPUs torch sees; Python, the platform and the CPUs this process may use; the launcher and
communication variables that change how a run behaves (torchrun's, SLURM's, ``NCCL_*``,
``TORCH_*``, ``CUDA_VISIBLE_DEVICES``, ``OMP_NUM_THREADS``); and which optional extras are
installed, found with ``importlib.util.find_spec`` and their package metadata (nothing is imported
but torch).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
from collections.abc import Sequence
from typing import Any

from ddpkit._version import __version__
from ddpkit.errors import EXIT_OK

__all__ = ["environment", "format_environment", "main", "EXTRAS"]

#: Optional packages ddpkit uses (import and distribution names are the same) -> the extra that installs them.
EXTRAS = {
    "tensorboard": "tensorboard",
    "matplotlib": "plot",
    "torchdata": "stream",
    "webdataset": "stream",
    "datasets": "hf",
    "mlflow": "mlflow",
    "wandb": "wandb",
    "tokenizers": "tokenizers",
    "safetensors": "safetensors",
}
# Variables that change a run: torchrun's and torchelastic's, SLURM's, the communication libraries'.
_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CUDA_VISIBLE_DEVICES",
    "OMP_NUM_THREADS",
    "GLOO_SOCKET_IFNAME",
    "DDPKIT_CACHE_DIR",
)
_PREFIXES = ("TORCHELASTIC_", "SLURM_", "NCCL_", "TORCH_", "PYTORCH_")
# Never printed, whatever their prefix: a report is pasted into public issues.
_SECRET_HINTS = ("TOKEN", "KEY", "SECRET", "PASSWORD")


def environment() -> dict[str, Any]:
    """Everything ``ddpkit env`` reports, as a JSON-ready dict."""
    import torch
    import torch.distributed as dist

    return {
        "ddpkit": __version__,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": {
            "total": os.cpu_count(),
            "usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        },
        "cuda": _cuda(torch),
        "distributed": {
            "available": dist.is_available(),
            "gloo": dist.is_available() and dist.is_gloo_available(),
            "nccl": dist.is_available() and dist.is_nccl_available(),
            "nccl_version": _nccl_version(torch),
        },
        "extras": {name: _installed(name) for name in EXTRAS},
        "variables": variables(os.environ),
    }


def variables(environ: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    """The run-relevant variables of ``environ``, sorted; anything that looks like a credential is left out."""
    chosen = {
        k: v
        for k, v in environ.items()
        if (k in _VARIABLES or k.startswith(_PREFIXES)) and not any(h in k for h in _SECRET_HINTS)
    }
    return dict(sorted(chosen.items()))


def _cuda(torch: Any) -> dict[str, Any]:
    available = torch.cuda.is_available()
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if available else []
    cudnn = torch.backends.cudnn.version() if available and torch.backends.cudnn.is_available() else None
    return {"available": available, "version": torch.version.cuda, "cudnn": cudnn, "gpus": gpus}


def _nccl_version(torch: Any) -> str | None:
    """The NCCL torch was built with (asked of the library: no GPU needed), or None."""
    if torch.version.cuda is None:
        return None
    try:
        version = torch.cuda.nccl.version()
    except Exception:
        # A build without NCCL
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _installed(distribution: str) -> str | None:
    """The installed version of ``distribution``, or None (never imports it)."""
    if importlib.util.find_spec(distribution) is None:
        return None
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "installed"


def format_environment(env: dict[str, Any]) -> str:
    """The aligned text ``ddpkit env`` prints."""
    cuda = env["cuda"]
    comm = env["distributed"]
    rows = [
        ("ddpkit", env["ddpkit"]),
        ("torch", env["torch"]),
        ("python", env["python"]),
        ("platform", env["platform"]),
        ("CPUs", f"{env['cpus']['usable']} usable of {env['cpus']['total']}"),
        (
            "CUDA",
            f"{'available' if cuda['available'] else 'not available'} "
            f"(torch built with CUDA {cuda['version'] or 'none'})",
        ),
        ("cuDNN", cuda["cudnn"] or "-"),
        ("GPUs", ", ".join(cuda["gpus"]) or "none"),
        (
            "NCCL",
            f"{'available' if comm['nccl'] else 'not available'}"
            + (f" {comm['nccl_version']}" if comm["nccl_version"] else ""),
        ),
        ("Gloo", "available" if comm["gloo"] else "not available"),
    ]
    lines = [f"{name:<10} {value}" for name, value in rows]
    lines.append("extras     " + ", ".join(f"{name} {version or '-'}" for name, version in env["extras"].items()))
    lines.append("variables" + ("" if env["variables"] else "  none set"))
    lines += [f"  {key}={value}" for key, value in env["variables"].items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``ddpkit env [--json]``; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="ddpkit env", description="Versions, devices, variables and extras, to paste into a bug report."
    )
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    args = parser.parse_args(argv)
    env = environment()
    print(json.dumps(env, indent=1) if args.json else format_environment(env))
    return EXIT_OK
