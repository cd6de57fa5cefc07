"""Which config values are object-storage URLs, and the checks on them (``checkpoint.dir``).

    url_scheme("s3://bucket/run")      # -> "s3"
    url_scheme("runs/x/checkpoints")   # -> None: a local path
    url_problems(directory="ftp://x/y", output_dir=None, storage_options={})  # ["checkpoint.dir: unknown ..."]

A URL ``checkpoint.dir`` is mirrored by :mod:`ddpkit.checkpoint.storage`; the run still writes its
checkpoints first into a local staging folder, ``<output_dir>/checkpoints``, so ``Config.checkpoint_dir``
stays a local path. This module only reads strings: it imports no storage client.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["STORAGE_SCHEMES", "url_scheme", "url_problems"]

#: Scheme -> the ddpkit extra whose fsspec backend serves it (``None``: fsspec itself).
STORAGE_SCHEMES = {
    "s3": "s3",
    "gs": "gcs",
    "gcs": "gcs",
    "az": "azure",
    "abfs": "azure",
    "abfss": "azure",
    "file": None,
    "memory": None,
}
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# A colon right after a scheme-like word with one slash or none ("s3:bucket", "s3:/bucket") is a mistyped URL,
# which a plain path would silently turn into a local folder named "s3:".
_ALMOST_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):/?(?!/)")


def url_scheme(value: str | None) -> str | None:
    """The lower-case scheme of ``value`` when it is a URL (``scheme://...``), else None (a local path)."""
    match = _URL.match(value or "")
    return match.group(1).lower() if match else None


def url_problems(*, directory: str | None, output_dir: str | None, storage_options: dict[str, Any]) -> list[str]:
    """URL mistakes in ``checkpoint.dir`` (``directory``) and ``run.output_dir``, as ``"path: message"`` strings."""
    problems = []
    scheme = url_scheme(directory)
    known = ", ".join(f"{s}://" for s in STORAGE_SCHEMES if s != "memory")
    if scheme is not None and scheme not in STORAGE_SCHEMES:
        problems.append(f"checkpoint.dir: unknown storage scheme '{scheme}://' in {directory}; use one of {known}")
    elif (
        scheme is None
        and directory
        and (almost := _ALMOST_URL.match(directory))
        and almost.group(1).lower() in STORAGE_SCHEMES
    ):
        fixed = f"{almost.group(1)}://{directory[almost.end() :]}"
        problems.append(f"checkpoint.dir: {directory} is not a URL (it would be a local folder); did you mean {fixed}?")
    if url_scheme(output_dir) is not None:
        problems.append(
            f"run.output_dir: {output_dir} must be a local folder (logs and the staging copy of checkpoints); "
            "set checkpoint.dir to the URL instead: the checkpoints, metrics.jsonl and model.pt are mirrored there"
        )
    if storage_options and scheme is None:
        problems.append(
            "checkpoint.storage_options: only used when checkpoint.dir is a URL (s3://, gs://, az://); remove it"
        )
    return problems
