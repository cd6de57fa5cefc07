"""Every rank's output, line by line, from the Spark executors to the driver's stderr.

    with LogRelay(host="10.0.0.1") as relay:              # the driver: a TCP server on a free port
        ... tasks run LogSender(relay.address, relay.token, rank=r).send(line) ...
        relay.tail(1)                                      # rank 1's last lines, for the failure report

A Spark executor's stdout goes to that executor's log files; a Horovod user expects the job's output
where the job was started. Each barrier task connects once per attempt and sends its rank's lines;
the driver prints each one, prefixed ``[rank R]`` when the line does not say its rank already
(ddpkit's own lines start with ``[rankR]``), and keeps the last :data:`TAIL_LINES` of each rank.
The first line a connection sends must be the relay's token (random per run), so nothing but the
run's own tasks writes into the driver's output. Logging is best effort: a task whose connection
fails goes on training, its lines still in the executor's log.
"""

from __future__ import annotations

import collections
import hmac
import secrets
import socket
import socketserver
import sys
import threading
from typing import Any, TextIO

__all__ = ["LogRelay", "LogSender", "TAIL_LINES"]

#: Lines kept per rank for the report of a failed attempt.
TAIL_LINES = 40


class LogRelay:
    """The driver's side: a threaded TCP server printing what the tasks send to ``out`` (default stderr)."""

    def __init__(self, host: str, *, out: TextIO | None = None) -> None:
        self.token = secrets.token_hex(16)
        self._out = out
        self._lock = threading.Lock()
        self._tails: dict[int, collections.deque[str]] = collections.defaultdict(
            lambda: collections.deque(maxlen=TAIL_LINES)
        )
        relay = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                relay._serve(self.rfile)

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self._server = socketserver.ThreadingTCPServer((host, 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="ddpkit-spark-logs", daemon=True)

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) the tasks connect to."""
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def __enter__(self) -> LogRelay:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def tail(self, rank: int) -> list[str]:
        """The last lines rank ``rank`` sent (of any attempt)."""
        with self._lock:
            return list(self._tails.get(rank, ()))

    def _serve(self, lines: Any) -> None:
        first = lines.readline().decode(errors="replace").strip()
        token, _, rank_text = first.partition(" ")
        if not hmac.compare_digest(token, self.token) or not rank_text.isdigit():
            return  # not one of this run's tasks
        rank = int(rank_text)
        for raw in lines:
            self.write(rank, raw.decode(errors="replace").rstrip("\n"))

    def write(self, rank: int, line: str) -> None:
        """Print one of rank ``rank``'s lines on the driver and keep it in that rank's tail."""
        shown = line if line.startswith(f"[rank{rank}]") else f"[rank {rank}] {line}"
        with self._lock:
            self._tails[rank].append(line)
            out = self._out or sys.stderr
            out.write(shown + "\n")
            out.flush()


class LogSender:
    """A task's side: one connection to the driver's relay; :meth:`send` never raises."""

    def __init__(self, address: tuple[str, int], token: str, *, rank: int, timeout: float = 10.0) -> None:
        self._sock: socket.socket | None = None
        try:
            self._sock = socket.create_connection(address, timeout=timeout)
            self._sock.sendall(f"{token} {rank}\n".encode())
        except OSError as exc:
            self._give_up(exc)

    def send(self, line: str) -> None:
        if self._sock is None:
            return
        try:
            self._sock.sendall(line.rstrip("\n").encode(errors="replace") + b"\n")
        except OSError as exc:
            self._give_up(exc)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _give_up(self, exc: OSError) -> None:
        print(f"ddpkit spark: this rank's lines stay in the executor's log (the driver's relay: {exc})", flush=True)
        if self._sock is not None:
            self._sock.close()
        self._sock = None
