"""One node's heartbeats in shared memory: each rank writes its own slot, the rank that leads the node reads them all.

    board = NodeBoard.open(board_name(key, "ddpkit/watchdog/1", node=3), slots=8, index=local_rank)
    board.write({"step": 12, "phase": "forward", "t": time.time()})   # every rank, twice a second: a copy, no syscall
    board.read(5)                      # the leader: local rank 5's last beat (a dict), or None before its first
    board.relay({"alarm": {...}})      # the leader: what the store said, for its node-mates
    board.relayed(0)                   # a node-mate: what local rank 0 relayed when it last led
    board.close()

Why not the store: at 100,000 ranks a heartbeat per rank through the job's TCPStore is 200,000 store
operations a second, and rank 0 reading them all cannot keep up (docs/scaling.md, "The control
plane"). Ranks of one node share a machine, so their heartbeats go through a file in ``/dev/shm``
(one 4 KiB slot per local rank, mapped into every rank of the node) and only the node's leader
talks to the store for them. A rank that is frozen (SIGSTOP, a C call holding the GIL) leaves its
last beat in its slot, with the wall time it wrote it: its leader sees it age.

Each slot holds a beat area and a relay area, each ``<sequence> <length> <crc32> <JSON>``; a reader
that catches a write half done sees a checksum that does not match and keeps what it read before.
The file is made ``0600`` (the user's own processes only) and removed as soon as every rank of the
node has written once (the mappings stay), so a job killed with SIGKILL leaves nothing in ``/dev/shm``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import struct
import tempfile
import zlib
from pathlib import Path
from typing import Any

__all__ = ["NodeBoard", "board_name", "SLOT_BYTES"]

#: Per local rank: a beat area, then a relay area
SLOT_BYTES = 4096
_BEAT_BYTES = 1024
#: Sequence, payload length, crc32 of the payload
_HEADER = struct.Struct("<QII")


def board_name(key: bytes, prefix: str, *, node: int) -> str:
    """The file name every rank of one node of one job derives alike (no message needed to agree on it).

    It covers the job's key (another job on the host, or a stranger, cannot guess it), the watchdog's
    store prefix (one board per ``fit()``), torchrun's run id and restart count, the store's address
    and the node: two "nodes" on one host (loopback tests) get two boards.
    """
    env = os.environ
    seen = "|".join(
        [
            prefix,
            env.get("TORCHELASTIC_RUN_ID", ""),
            env.get("TORCHELASTIC_RESTART_COUNT", "0"),
            env.get("MASTER_ADDR", ""),
            env.get("MASTER_PORT", ""),
            str(node),
        ]
    )
    return f"ddpkit-watchdog-{hashlib.sha256(key + b'|' + seen.encode()).hexdigest()[:24]}"


def _directory() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


class NodeBoard:
    """The mapped file of one node; see the module docstring."""

    def __init__(self, page: mmap.mmap, path: Path, *, slots: int, index: int):
        self.page = page
        self.path = path
        self.slots = slots
        self.index = index
        self._seq = 0
        self._relay_seq = 0
        # Offset -> (sequence, value): a torn read keeps the last good value
        self._cache: dict[int, Any] = {}
        self._unlinked = False

    @classmethod
    def open(cls, name: str, *, slots: int, index: int) -> NodeBoard:
        path = _directory() / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            size = slots * SLOT_BYTES
            if os.fstat(fd).st_size < size:
                # Every rank may do it: the same size, zeros
                os.ftruncate(fd, size)
            page = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(page, path, slots=slots, index=index)

    def _put(self, offset: int, limit: int, seq: int, value: Any) -> None:
        data = json.dumps(value, separators=(",", ":")).encode()
        if len(data) > limit - _HEADER.size:
            data = json.dumps({"error": f"record of {len(data)} bytes does not fit"}).encode()
        end = offset + _HEADER.size + len(data)
        self.page[offset + _HEADER.size : end] = data
        self.page[offset : offset + _HEADER.size] = _HEADER.pack(seq, len(data), zlib.crc32(data))

    def _get(self, offset: int) -> Any:
        seq, length, crc = _HEADER.unpack_from(self.page, offset)
        cached = self._cache.get(offset)
        if seq == 0 or (cached is not None and cached[0] == seq) or length > SLOT_BYTES:
            return cached[1] if cached else None
        data = self.page[offset + _HEADER.size : offset + _HEADER.size + length]
        if zlib.crc32(data) != crc:
            # Caught mid-write: the last good value now, the new one next time
            return cached[1] if cached else None
        try:
            value = json.loads(data)
        except ValueError:
            return cached[1] if cached else None
        self._cache[offset] = (seq, value)
        return value

    def write(self, beat: dict[str, Any]) -> None:
        """This rank's beat, in its own slot."""
        self._seq += 1
        self._put(self.index * SLOT_BYTES, _BEAT_BYTES, self._seq, beat)

    def read(self, index: int) -> dict[str, Any] | None:
        """Local rank ``index``'s last beat, or None when it has not written yet."""
        return self._get(index * SLOT_BYTES)

    def relay(self, message: dict[str, Any]) -> None:
        """What this rank, leading its node, passes on from the store to its node-mates."""
        self._relay_seq += 1
        self._put(self.index * SLOT_BYTES + _BEAT_BYTES, SLOT_BYTES - _BEAT_BYTES, self._relay_seq, message)

    def relayed(self, index: int) -> dict[str, Any]:
        """What local rank ``index`` relayed when it last led ({} if never)."""
        return self._get(index * SLOT_BYTES + _BEAT_BYTES) or {}

    def forget_file(self) -> None:
        """Remove the file once every slot has been written: every rank has it mapped, nobody opens it again."""
        if self._unlinked or any(_HEADER.unpack_from(self.page, i * SLOT_BYTES)[0] == 0 for i in range(self.slots)):
            return
        self._unlinked = True
        with contextlib.suppress(OSError):
            self.path.unlink()

    def close(self) -> None:
        """Remove the file if it is still there (a node-mate that never came); the mapping stays for late writers."""
        self._unlinked = True
        with contextlib.suppress(OSError):
            self.path.unlink()
