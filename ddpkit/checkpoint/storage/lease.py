"""The run lock on an object store: one writer per ``checkpoint.dir`` URL, as a lease with fencing epochs.

    lease = acquire(store)          # rank 0 at start: RunDirectoryLocked (exit 2) when a live run holds it
    renew(store, lease)             # every RENEW_S seconds (the upload process): False once lost
    release(store, lease)           # at the end: the lock object goes, if it is still ours

Taking the lock is creating the next epoch's fence, ``.ddpkit/epoch-<N+1>.json``, create-only: of two
runs starting at once exactly one succeeds. The fence lists the checkpoints that counted when the
epoch began; every manifest the holder writes carries its epoch, so a manifest counts only if it
belongs to the newest epoch or is listed by its fence (:func:`ddpkit.checkpoint.storage.layout.counting`).
A run that lost its lease (a frozen VM that wakes up an hour later) can still write objects, but
nothing it publishes counts, and its retention deletes nothing.

``.ddpkit/lock.json`` says who holds it and when they last renewed it. A holder is alive when, on
this host, its pid runs (with the same start time); on another host, when the lock was renewed
within LEASE_S, confirmed by watching it change (at most LEASE_S). A dead holder's lock is taken over
at once, so the same command resumes after every process was killed. On a store without
conditional writes the fence is only checked before it is written: a loud warning says so.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass

from ddpkit.checkpoint.run_lock import RunDirectoryLocked, start_ticks
from ddpkit.checkpoint.storage.layout import FENCE_PREFIX, find_remote, newest_fence
from ddpkit.checkpoint.storage.store import Store
from ddpkit.distributed.processes import is_alive

__all__ = ["Lease", "LEASE_S", "RENEW_S", "LOCK_OBJECT", "acquire", "renew", "release"]

log = logging.getLogger("ddpkit")

LOCK_OBJECT = ".ddpkit/lock.json"
#: Seconds between renewals of the lock object by its holder.
RENEW_S = 5.0
#: A lock not renewed for this long belongs to a run that is gone (three missed renewals and some slack).
LEASE_S = 4 * RENEW_S


@dataclass(frozen=True)
class Lease:
    """This run's hold on the store: its fencing epoch, the token its lock object carries, and the holding
    process (rank 0's trainer, also when its upload process renews the lock)."""

    epoch: int
    token: str
    pid: int
    start_ticks: str | None


def acquire(store: Store, *, attempts: int = 3) -> Lease:
    """Take the store's lock (taking over a dead holder's), or raise :class:`RunDirectoryLocked` naming the holder."""
    token = secrets.token_hex(8)
    for _ in range(attempts):
        holder = _read(store)
        verdict = _alive(store, holder) if holder is not None else "gone"
        if verdict == "changed":
            # Released or taken by another run while we watched: judge the new holder
            continue
        if verdict == "alive":
            raise RunDirectoryLocked(
                f"checkpoint.dir={store.url} is in use by another run (pid {holder.get('pid')} on "
                f"{holder.get('host')}, renewing its lock there): give this run another checkpoint.dir, "
                "or stop that run first"
            )
        fence = newest_fence(store)
        epoch = (fence or {}).get("epoch", 0) + 1
        # What counts now keeps counting under the new epoch
        accepted = [c.name for c in find_remote(store)]
        try:
            store.put_bytes(
                f"{FENCE_PREFIX}{epoch:09d}.json",
                json.dumps({"epoch": epoch, "accepted": accepted, "token": token}).encode(),
                create=True,
            )
        except FileExistsError:
            # Another run took this epoch a moment ago: look again
            continue
        if holder is not None:
            log.warning(
                "ddpkit: taking over the lock of %s from pid %s on %s, which is no longer running",
                store.url,
                holder.get("pid"),
                holder.get("host"),
            )
        lease = Lease(epoch, token, os.getpid(), start_ticks(os.getpid()))
        _write(store, lease)
        return lease
    raise RunDirectoryLocked(f"checkpoint.dir={store.url}: could not take its lock; is another run starting there?")


def renew(store: Store, lease: Lease) -> bool:
    """Refresh the lock object; False (and nothing written) once a newer epoch exists: the lease is lost."""
    fence = newest_fence(store)
    if fence is not None and fence.get("epoch") != lease.epoch:
        return False
    _write(store, lease)
    return True


def release(store: Store, lease: Lease) -> None:
    """Remove the lock object if it is still this run's (a run that took over keeps its own)."""
    holder = _read(store)
    if holder is not None and holder.get("token") == lease.token:
        store.delete([LOCK_OBJECT])


def _write(store: Store, lease: Lease) -> None:
    fields = {
        "host": socket.gethostname(),
        "pid": lease.pid,
        "start_ticks": lease.start_ticks,
        "epoch": lease.epoch,
        "token": lease.token,
        "renewed": time.time(),
    }
    store.put_bytes(LOCK_OBJECT, json.dumps(fields).encode())


def _read(store: Store) -> dict | None:
    data = store.get_bytes(LOCK_OBJECT)
    if data is None:
        return None
    try:
        holder = json.loads(data)
    except ValueError:
        # Unreadable: treated as a holder that never renews, taken over after LEASE_S
        return {}
    return holder if isinstance(holder, dict) else {}


def _alive(store: Store, holder: dict) -> str:
    """``alive`` (its pid on this host runs, or a renewal was seen), ``dead``, or ``changed`` (another holder now)."""
    if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
        ticks = holder.get("start_ticks")
        return "alive" if is_alive(holder["pid"]) and (ticks is None or start_ticks(holder["pid"]) == ticks) else "dead"
    renewed = holder.get("renewed")
    if not isinstance(renewed, (int, float)) or time.time() - renewed > LEASE_S:
        return "dead"
    # Renewed recently by its own clock: believe it only once we see it renewed again (clocks may disagree).
    deadline = time.monotonic() + LEASE_S
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = _read(store)
        if now is None or now.get("token") != holder.get("token"):
            return "changed"
        if now.get("renewed") != renewed:
            return "alive"
    return "dead"
