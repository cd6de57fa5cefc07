"""After a failed ``fit()``: the failing rank waits until the other ranks have read its failure.

    announce(watchdog, wait=2.0)   # from ddpkit.watchdog.heartbeat.announce_failure, once stop(error) published it

A rank that hosts the store (rank 0 under ``ddpkit run``) takes it with it when it exits, so the
publisher waits until every other rank has counted itself in ``failed_seen`` (a node-mate that is
gone never will: its pid from the node's board says so) and then sets ``failed_done``; rank 0, when
another rank published first, waits for ``failed_done`` before it exits.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ddpkit.watchdog.monitor import GATHER_WAIT
from ddpkit.watchdog.store_io import process_gone

__all__ = ["announce"]


def _failed_done(wd: Any) -> Callable[[], Any]:
    return lambda: wd.client.get_if_set("failed_done")


def announce(wd: Any, wait: float) -> None:
    """The body of :func:`ddpkit.watchdog.heartbeat.announce_failure` for the watchdog ``wd``."""
    # This rank's error is a consequence of the hang being reported (a peer exited)
    if wd.handling_hang:
        # The watchdog thread writes the report and ends the process meanwhile
        time.sleep(GATHER_WAIT + 20)
        return
    deadline = time.monotonic() + wait
    # Another rank's alarm came first (this rank's error is probably its consequence)
    if not wd.published_failure:
        # Rank 0 may host the store: stay until the publisher has stopped reading it, or its
        # store client prints a C++ stack trace ("recvValue failed") for a store that went away.
        while wd.rank == 0 and time.monotonic() < deadline and wd._try(_failed_done(wd)) is None:
            time.sleep(0.05)
        return
    # A node-mate that is gone never reads it
    peers = [beat["pid"] for beat in wd.node.mates() if beat.get("pid")]
    while time.monotonic() < deadline:
        seen = wd._try(lambda: wd.client("add", "failed_seen", 0))
        if seen is None or seen + sum(map(process_gone, peers)) >= wd.world_size - 1:
            break
        time.sleep(0.1)
    wd._try(lambda: wd.client("set", "failed_done", "1"))
