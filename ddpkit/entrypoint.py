"""Running a training entry point so that failures are clear and reach torchrun's summary.

``run_entrypoint(fn)`` calls ``fn`` under torch's ``@record``, which writes an unexpected
exception and its traceback to the error file torchrun reads, so the failing rank's traceback
appears in the launcher's summary. A :class:`~ddpkit.errors.DdpkitError` (bad config, bad launch,
bad data, bad checkpoint) is the user's to fix, not a bug: it is printed as one clear message,
recorded in the error file without a traceback, and becomes the exit code (2 for config errors,
else 1).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from ddpkit.errors import DdpkitError

__all__ = ["run_entrypoint"]


def run_entrypoint(fn: Callable[[], Any]) -> int:
    """Run ``fn``; return 0 on success or the exit code of the DdpkitError it raised."""
    from torch.distributed.elastic.multiprocessing.errors import record

    def guarded() -> int:
        try:
            fn()
        except DdpkitError as exc:
            rank = f" (rank {os.environ['RANK']})" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
            print(f"ddpkit: error{rank}: {exc}", file=sys.stderr, flush=True)
            _write_error_file(exc)
            return exc.exit_code
        return 0

    return record(guarded)()


def _write_error_file(exc: DdpkitError) -> None:
    """Tell torchrun's summary what failed, in its error-file format, without a traceback."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    text = f"{type(exc).__name__}: {exc}"
    payload = {"message": {"message": text, "extraInfo": {"py_callstack": text, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(payload, f)
    except OSError:
        pass  # the message is already on stderr
