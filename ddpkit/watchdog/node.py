"""A rank's place in its node: every rank beats into the node's board; one rank speaks for the node in the store.

    node = Node(board, client, rank=9, local_world_size=8, nodes=2, interval=0.5)
    news = node.step(beat)          # each heartbeat: write the beat, lead if it is this rank's turn; the relay
    node.progressed, node.slow      # after a step that led: did a rank of this node progress, is one in a slow phase
    node.news["done"] = {...}       # the leader passes this on to its node-mates at its next step

Who leads: the lowest local rank whose beat is fresh (under :data:`LEADER_STALE` old) and not done, so
a frozen or finished local rank 0 hands the node over without a message. Per heartbeat, the leader
reads its node-mates' beats from shared memory (:mod:`ddpkit.watchdog.node_board`) and, in the store:

* sets ``progress`` when a rank of its node changed step, phase or counter or ran new code (every
  other beat beyond 6,250 nodes), and ``slow`` when one is in a slow phase (a set is not waited for).
  Rank 0 reads these two keys, never the nodes' records: its cost does not grow with the job;
* sets ``node/<n>``, the node's beats and its silent ranks, every :data:`RECORD_EVERY` seconds, and at
  once and then every second while a hang is reported (the report reads them);
* reads ``alarm`` (then ``want`` and ``done`` while a hang is reported) once every few heartbeats, staggered
  by node so that all leaders together make at most :data:`POLLS_PER_SECOND` round trips, and relays
  what it read to its node-mates through the board.
"""

from __future__ import annotations

import json
import math
import socket
import time
from typing import Any

from ddpkit.watchdog.node_board import NodeBoard
from ddpkit.watchdog.store_io import StoreClient

__all__ = ["Node", "LEADER_STALE", "SILENT_AFTER", "RECORD_EVERY", "POLLS_PER_SECOND", "SETS_PER_SECOND"]

#: Seconds without a beat before the next local rank leads the node
LEADER_STALE = 3.0
#: A beat older than this: the rank is frozen, stopped or gone
SILENT_AFTER = 10.0
#: Seconds between a node's records while nothing is wrong
RECORD_EVERY = 5.0
#: Round trips to the store for all leaders' polls together (it takes ~45,000 on 2 cores)
POLLS_PER_SECOND = 2500
#: Beyond this many nodes' progress sets a second, each node sets every other beat
SETS_PER_SECOND = 12_500


class Node:
    """This rank's side of its node; see the module docstring."""

    def __init__(
        self, board: NodeBoard, client: StoreClient, *, rank: int, local_world_size: int, nodes: int, interval: float
    ):
        self.board = board
        self.client = client
        self.local = rank % local_world_size
        self.size = local_world_size
        self.node = rank // local_world_size
        self.first = rank - self.local
        # Heartbeats between polls
        self.poll_every = max(1, math.ceil(nodes / (POLLS_PER_SECOND * interval)))
        # Seconds for news in the store to reach every node
        self.poll_period = self.poll_every * interval
        # Every other beat at most: in step with the others, some node sets it every beat anyway; a node that
        # progresses alone (a long load while the others wait) is then seen a beat late, within the 2 s allowed.
        self.set_every = 2 if nodes > SETS_PER_SECOND * interval else 1
        # Progress seen since this node last set ``progress``
        self._pending = False
        self.turn = 0
        self.leading = False
        # Wall time the previous leader last beat, when this rank took over
        self.took_over_at: float | None = None
        self.progressed = False
        self.slow = False
        # What this rank relays while it leads: alarm, want, done, alone
        self.news: dict[str, Any] = {}
        self.host = socket.gethostname()
        self.started = time.time()
        self._marks: dict[int, tuple[Any, ...]] = {}
        self._record_at = 0.0
        # The hang the last record answered
        self._recorded_for: str | None = None
        self._relayed: dict[str, Any] | None = None

    def leader(self, now: float) -> int:
        """The local rank that leads: the lowest one with a fresh beat that is not done (this rank at worst)."""
        for index in range(self.local):
            beat = self.board.read(index)
            if beat and now - beat.get("t", 0.0) < LEADER_STALE and beat.get("phase") != "done":
                return index
        return self.local

    def step(self, beat: dict[str, Any], *, handling: str | None = None) -> dict[str, Any]:
        """Write ``beat``; lead the node if it is this rank's turn (``handling``: the hang being reported)."""
        self.board.write(beat)
        self.board.forget_file()
        now = time.time()
        leader = self.leader(now)
        if leader != self.local:
            self.leading = False
            self.progressed = False
            self.slow = False
            return self.board.relayed(leader)
        if not self.leading:
            self.leading = True
            # The first survey is the baseline
            self._marks.clear()
            earlier = [b.get("t", self.started) for i in range(self.local) if (b := self.board.read(i))]
            self.took_over_at = max(earlier) if earlier else None
            inherited: dict[str, Any] = {}
            # What the previous leader had relayed is not news to the mates
            for index in range(self.local):
                inherited.update(self.board.relayed(index))
            self.news = {**inherited, **self.news}
        beats, silent = self.survey(now)
        self.publish(beats, silent, now, handling)
        return self.news

    def survey(self, now: float) -> tuple[dict[int, dict[str, Any]], dict[int, float]]:
        """The node's beats, and its silent ranks -> the wall time of their last beat; sets progressed and slow."""
        beats = {}
        silent = {}
        progressed = False
        slow = False
        for index in range(self.size):
            rank = self.first + index
            beat = self.board.read(index)
            if beat is None:
                if now - self.started > SILENT_AFTER:
                    silent[rank] = self.started
                continue
            beats[rank] = beat
            if beat.get("phase") == "done":
                continue
            if now - beat.get("t", 0.0) > SILENT_AFTER:
                silent[rank] = beat.get("t", self.started)
                continue
            mark = (beat.get("step"), beat.get("phase"), beat.get("ticks"), beat.get("novel"))
            progressed |= self._marks.get(index) != mark
            self._marks[index] = mark
            slow |= bool(beat.get("slow"))
        self.progressed = progressed
        self.slow = slow
        return beats, silent

    def publish(
        self, beats: dict[int, dict[str, Any]], silent: dict[int, float], now: float, handling: str | None
    ) -> None:
        """The node's sets and, on its turn, its poll; then the relay to its node-mates."""
        self.turn += 1
        tag = f"{self.node}:{self.turn}"
        self._pending |= self.progressed
        if self._pending and (self.turn + self.node) % self.set_every == 0:
            self.client("set", "progress", tag)
            self._pending = False
        if self.slow:
            self.client("set", "slow", tag)
        if now - self._record_at >= (RECORD_EVERY if handling is None else 1.0) or handling != self._recorded_for:
            self.record(beats, silent, now, handling)
        if (self.turn + self.node) % self.poll_every == 0:
            self.poll(handling)
        if self.news != self._relayed and self.size > 1:
            self.board.relay(self._for_mates(self.news))
            self._relayed = dict(self.news)

    def record(
        self, beats: dict[int, dict[str, Any]], silent: dict[int, float], now: float, handling: str | None
    ) -> None:
        record = {"node": self.node, "host": self.host, "t": now, "alarm": handling, "beats": beats, "silent": silent}
        self.client("set", f"node/{self.node}", json.dumps(record, separators=(",", ":")))
        self._record_at = now
        self._recorded_for = handling

    def poll(self, handling: str | None) -> None:
        """Read what the store has for this node: an alarm; while a hang is reported, whose stacks and the end."""
        for key in ("alarm",) if handling is None else ("want", "done"):
            if key not in self.news and (raw := self.client.get_if_set(key)) is not None:
                self.news[key] = json.loads(raw)

    def _for_mates(self, news: dict[str, Any]) -> dict[str, Any]:
        """The relay, cut to this node: the wanted and stuck ranks of other nodes are none of its business."""
        mine = range(self.first, self.first + self.size)
        out = dict(news)
        if "want" in out:
            out["want"] = [r for r in out["want"] if r in mine]
        if "done" in out:
            out["done"] = {**out["done"], "stuck": [r for r in out["done"].get("stuck", []) if r in mine]}
        return out

    def mates(self) -> list[dict[str, Any]]:
        """The other ranks of this node, as their last beats say (pid, host)."""
        return [b for i in range(self.size) if i != self.local and (b := self.board.read(i))]
