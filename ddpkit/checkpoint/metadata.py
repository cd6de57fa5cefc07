"""What a checkpoint says about the run that wrote it: one place builds it for every kind of save.

    state = components.capture(metadata=run_metadata(config, world_size=2))   # inside the file
    save_checkpoint(state, directory, step=step, meta=manifest_fields(state, epoch=3))   # the manifest beside it

The periodic save, the crash save, memory snapshots and sharded saves all write the same fields, so
``ddpkit runs``, the resume check and a reader of the manifests see one shape whoever wrote it;
what differs (``crash_save``, ``memory``) is passed as an extra field by the writer that differs.
"""

from __future__ import annotations

from typing import Any

import torch

from ddpkit._version import __version__
from ddpkit.config.schema import Config
from ddpkit.config.serialize import config_hash, config_to_dict

__all__ = ["run_metadata", "manifest_fields"]


def run_metadata(config: Config, *, world_size: int) -> dict[str, Any]:
    """The run's fields a checkpoint file holds beside its parts (see ``components.METADATA_KEYS``)."""
    return {
        "world_size": world_size,
        "config": config_to_dict(config),
        "config_hash": config_hash(config),
        "versions": {"ddpkit": __version__, "torch": str(torch.__version__)},
    }


def manifest_fields(state: dict[str, Any], *, epoch: int, **extra: Any) -> dict[str, Any]:
    """The manifest's fields beyond size and checksum, taken from the captured ``state`` (``extra``: e.g.
    ``memory=True``)."""
    return {"epoch": epoch, "config_hash": state["config_hash"], "versions": state["versions"], **extra}
