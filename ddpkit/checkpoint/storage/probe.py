"""The start-up probe: can every node write, read and delete under ``checkpoint.dir``?

    store = probe_store("s3://bucket/run", {}, host="node-3", rank=24)   # ConfigError naming the URL and the fix

A missing bucket, missing or invalid credentials, a store this job may read but not write: each is
found here, before training, and refused in one line (exit 2), not at the first save hours in.
The probe also tells whether the store refuses a second create-only write of the same object
(conditional writes: what makes the run lock and the manifests safe); where it does not, the lock
is best effort and a loud warning says so.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ddpkit.checkpoint.storage.store import Store, open_store
from ddpkit.errors import ConfigError, DdpkitError, first_line

__all__ = ["probe_store", "why", "with_retries", "START_ATTEMPTS"]

T = TypeVar("T")
#: Tries of a start-up call (the probe, the lock, the fetch) before a transient error (a 503, a reset connection)
#: counts as the store's answer; a missing bucket, missing credentials or a denied access count at once.
START_ATTEMPTS = 4

log = logging.getLogger("ddpkit")

_CAUSES = (
    (("NoSuchBucket", "bucket does not exist", "ContainerNotFound", "No such bucket"), "the bucket does not exist"),
    (
        ("NoCredentials", "Unable to locate credentials", "DefaultCredentialsError", "ClientAuthenticationError"),
        "no credentials were found (environment, profile, or instance/pod role)",
    ),
    (
        ("InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken", "AuthenticationFailed"),
        "the credentials are not valid (or have expired)",
    ),
    (
        ("AccessDenied", "Forbidden", "403", "AuthorizationPermissionMismatch", "PermissionError"),
        "access denied: these credentials may not write, read and delete there",
    ),
    (
        (
            "Could not connect",
            "Connect timeout",
            "ConnectionError",
            "EndpointConnectionError",
            "Name or service not known",
        ),
        "the store cannot be reached (endpoint, network)",
    ),
)


def why(exc: BaseException) -> str:
    """A store error in plain words: the cause when it is a known one, with the client's own first line."""
    text = f"{type(exc).__name__} {exc!r} {exc}"
    for needles, cause in _CAUSES:
        if any(needle in text for needle in needles):
            return f"{cause} ({first_line(exc)})"
    return first_line(exc)


def permanent(exc: BaseException) -> bool:
    """Whether a store error is its answer (no bucket, no or bad credentials, access denied), not a hiccup."""
    text = f"{type(exc).__name__} {exc!r} {exc}"
    return any(needle in text for needles, _ in _CAUSES[:4] for needle in needles)


def with_retries(
    call: Callable[[], T], store: Store, *, attempts: int = START_ATTEMPTS, sleep: Callable[[float], None] = time.sleep
) -> T:
    """``call()``, tried again on a new client (1, 2, 4 s apart) while the store fails transiently."""
    for attempt in range(1, attempts + 1):
        try:
            return call()
        except (FileExistsError, DdpkitError):
            # Answers (a refused create, a corrupt checkpoint, a held lock)
            raise
        except Exception as exc:
            if attempt == attempts or permanent(exc):
                raise
            log.warning("ddpkit: %s: %s; trying again", store.url, why(exc))
            sleep(2.0 ** (attempt - 1))
            store.rebuild()
    raise AssertionError("unreachable")


def probe_store(url: str, options: dict[str, Any], *, host: str, rank: int) -> Store:
    """Write, read back and delete one small object under ``url``; the open store, or ConfigError."""
    store = open_store(url, options)
    try:
        conditional = with_retries(lambda: _probe(store, f".ddpkit/probe-{host}-{rank}-{secrets.token_hex(4)}"), store)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(
            f"checkpoint.dir={url}: cannot write, read and delete there from {host} (rank {rank}): {why(exc)}; "
            "check the URL, the credentials and checkpoint.storage_options (docs/storage.md)"
        ) from None
    store.conditional = store.conditional and conditional
    return store


def _probe(store: Store, name: str) -> bool:
    """One write, read and delete of ``name``; whether the store refused a second create-only write of it."""
    payload = secrets.token_bytes(16)
    store.put_bytes(name, payload, create=True)
    conditional = _refuses_second_create(store, name)
    if store.get_bytes(name) != (payload if conditional else b"second"):
        raise OSError("what was read back differs from what was written")
    store.delete([name])
    return conditional


def _refuses_second_create(store: Store, name: str) -> bool:
    # The same name again, create-only: a store with conditional writes refuses it
    try:
        store.put_bytes(name, b"second", create=True)
    except FileExistsError:
        return True
    except Exception:
        # A store that rejects the header itself: no conditional writes
        return False
    return False
