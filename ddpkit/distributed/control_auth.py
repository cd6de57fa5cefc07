"""Tags on ddpkit's control messages in the job's store, made with a per-job secret that never goes through the store.

    key = agree_job_key()                          # every rank, once, right after the group is up (collective)
    raw = sign(key, "hb/1", '{"step": 12}')        # b"<64 hex digits> {"step": 12}": what goes into the store
    verify(key, "hb/1", raw)                       # '{"step": 12}'; None for a missing, wrong or foreign tag
    read_signed(key, "hb/1", raw)                  # verify, and log the first rejected message of each kind of key

The job's key-value store (a TCPStore) has no authentication: anything that reaches its port can
read and write every key. ddpkit's stop requests (:mod:`ddpkit.checkpoint.preemption`) and the
watchdog's heartbeats, alarms and stack reports (:mod:`ddpkit.watchdog`) travel through it, so each
value carries an HMAC-SHA256 tag over the key's name and the value. The secret comes from
``ddpkit run``, which creates one per job and hands it to its workers in ``DDPKIT_JOB_SECRET``
(torchrun passes its environment on; forked workers inherit it). Without it (plain ``torchrun``),
or when the ranks' secrets differ (each node's ``ddpkit run`` made its own), rank 0 creates one and
sends it over the process group, not through the store. The variable is removed from the workers'
environment once read, so the user's code, its child processes and trackers never see it; it is
never logged, and ``ddpkit env`` leaves out every variable named like a secret.

A message without a valid tag is ignored, and the first one of each kind of key (``hb/N``,
``alarm``, ``request``, ...) is logged with what was seen. Cost: about 2 us to sign plus about
2 us to verify a heartbeat (docs/multinode.md, "The job's store").
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import threading

__all__ = ["SECRET_ENV", "new_secret", "agree_job_key", "job_key", "sign", "verify", "read_signed"]

#: The variable ``ddpkit run`` hands the job's secret to its workers in.
SECRET_ENV = "DDPKIT_JOB_SECRET"

#: Hex digits of an HMAC-SHA256.
_TAG_LEN = 64
log = logging.getLogger("ddpkit")
#: job_key()'s key of this process alone (a run's key is held by its worker, not here).
_key: bytes | None = None
#: Kinds of key already reported as forged.
_logged: set[str] = set()
_lock = threading.Lock()


def new_secret() -> str:
    """A fresh job secret (256 random bits, hex), as ``ddpkit run`` puts in :data:`SECRET_ENV`."""
    return secrets.token_hex(32)


def _from_env() -> bytes | None:
    text = os.environ.pop(SECRET_ENV, "")
    return text.encode() if text else None


def agree_job_key() -> bytes:
    """The job's key, the same on every rank; a collective: every rank calls it once, right after the group is up.

    The launcher's secret when every rank was given the same one (one all-gather of its fingerprint,
    never the secret itself); else rank 0 makes one and broadcasts it over the process group.
    The key is returned, never kept here: the worker holds it (:class:`ddpkit.launch.worker_scope.Worker`)
    and hands it to what signs and reads the store (the stop on a signal, the watchdog).
    """
    from ddpkit.distributed.collectives import all_gather_object, broadcast_object

    given = _from_env()
    fingerprint = hashlib.sha256(b"ddpkit-fingerprint:" + given).hexdigest()[:16] if given else None
    prints = all_gather_object(fingerprint)
    if given is not None and len(set(prints)) == 1:
        return given
    return broadcast_object(new_secret().encode()) if len(prints) > 1 else (given or new_secret().encode())


def job_key() -> bytes:
    """A key of this process alone, made once (the launcher's secret if it is still unread): for a store client
    or watchdog driven by hand outside a run, as tests do. A run signs with the key its worker agreed."""
    global _key
    with _lock:
        if _key is None:
            _key = _from_env() or new_secret().encode()
        return _key


def _tag(key: bytes, name: str, value: bytes) -> bytes:
    return hmac.new(key, name.encode() + b"\0" + value, hashlib.sha256).hexdigest().encode()


def sign(key: bytes, name: str, value: str | bytes) -> bytes:
    """``value`` with its tag in front, for the store key ``name`` (the tag covers both: a message cannot be moved to
    another key)."""
    data = value.encode() if isinstance(value, str) else bytes(value)
    return _tag(key, name, data) + b" " + data


def verify(key: bytes, name: str, raw: bytes | str | None) -> str | None:
    """The value of a signed ``raw`` read from the key ``name``; None when missing, untagged or tagged with another
    key."""
    if raw is None:
        return None
    data = raw.encode() if isinstance(raw, str) else bytes(raw)
    if len(data) <= _TAG_LEN or data[_TAG_LEN : _TAG_LEN + 1] != b" ":
        return None
    value = data[_TAG_LEN + 1 :]
    if not hmac.compare_digest(data[:_TAG_LEN], _tag(key, name, value)):
        return None
    return value.decode(errors="replace")


def read_signed(key: bytes, name: str, raw: bytes | str | None) -> str | None:
    """:func:`verify`, logging the first rejected message of each kind of key (its name and a short repr of what was
    there)."""
    value = verify(key, name, raw)
    if value is None and raw is not None:
        kind = re.sub(r"\d+", "N", name)
        with _lock:
            first = kind not in _logged
            _logged.add(kind)
        if first:
            shown = bytes(raw) if not isinstance(raw, str) else raw.encode()
            log.warning(
                "ignored a message in the job's store without a valid ddpkit tag: key %r, value %r (%d bytes); "
                "someone else wrote to the job's store (docs/troubleshooting.md). "
                "Later ones of this kind are ignored silently",
                name,
                shown[:80],
                len(shown),
            )
    return value
