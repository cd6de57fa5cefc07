"""The watchdog's judge: decides that a job hangs, gathers the suspects' stacks, writes the report.

    monitor = Monitor(watchdog)   # one per Watchdog; its thread calls monitor.check() twice a second
    monitor.check()               # rank 0: reads two keys; the deputy: rank 0's record; the others: nothing

Rank 0 judges from ``progress`` and ``slow``, which the nodes' leaders set (:mod:`ddpkit.watchdog.node`):
a value it has not seen before is progress somewhere. The deputy (the first rank of node 1, or rank 1
when there is one node) takes over when rank 0's own record, ``judge``, stops changing (rank 0 frozen
while the store still answers, e.g. the store lives in torchrun's agent). The rank whose alarm won the
``compare_set`` writes the report from the nodes' records: it classifies the ranks, asks the suspects
for their stacks (``want``), and the others exit first, so torchrun's summary names the earliest
failure: the stuck rank, whose error file is dated to the start of the hang.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path
from typing import Any

from ddpkit.errors import EXIT_HANG
from ddpkit.watchdog.backstop import backstop_path, read_backstop
from ddpkit.watchdog.node import LEADER_STALE, SILENT_AFTER
from ddpkit.watchdog.report import SECTIONS, Verdict, classify, format_report, summary_line, thread_stacks
from ddpkit.watchdog.store_io import StoreDown, kill_frozen_sibling, terminate, write_error_file, write_text

__all__ = ["Monitor", "HANG_EXIT_CODE", "SILENT_AFTER", "deputy_rank", "report_alone"]

#: Every rank's exit code when the watchdog stops a hung job (3)
HANG_EXIT_CODE = EXIT_HANG
#: How long the reporting rank waits for the nodes' records, then for the stacks
GATHER_WAIT = 6.0
#: A ``slow`` set this recently means a live rank is in a slow phase (leaders set it each beat)
SLOW_FRESH = 2.0
#: Up to this many live ranks, the report has every rank's stacks; beyond, the suspects'
ALL_STACKS = SECTIONS
#: Beyond ALL_STACKS live ranks, the stacks of this many stuck ranks and of this many waiting ones
WANT_STUCK = 48
WANT_WAITING = 16


def deputy_rank(world_size: int, local_world_size: int) -> int:
    """The rank that watches rank 0: the first of node 1, or rank 1 when there is one node."""
    return local_world_size if world_size > local_world_size else 1


class Monitor:
    """Decides that the job hangs (rank 0, or the deputy once rank 0 is silent) and writes the report."""

    def __init__(self, watchdog: Any):
        self.wd = watchdog
        self.start = self.last_progress = self.slow_seen = time.monotonic()
        self.values: dict[str, bytes] = {}
        self.deputy = deputy_rank(watchdog.world_size, watchdog.local_world_size)
        self.judge: dict[str, Any] = {}
        self.judge_at = self.start

    def check(self) -> None:
        if self.wd.rank == 0:
            self._judge()
        elif self.wd.rank == self.deputy:
            self._watch_judge()

    def _judge(self) -> None:
        wd = self.wd
        now = time.monotonic()
        # Rank 0's own record, which the deputy watches
        wd.client("set", "judge", json.dumps(wd.last_beat))
        if wd.node.progressed:
            self.last_progress = now
        if wd.node.slow:
            self.slow_seen = now
        keys = ["progress", "slow"]
        # multi_get would wait for a missing key
        if wd.client("check", keys):
            for key, value in zip(keys, wd.client("multi_get", keys)):
                # None: no valid tag
                if value is not None and value != self.values.get(key):
                    self.values[key] = value
                    self.last_progress, self.slow_seen = (
                        (now, self.slow_seen) if key == "progress" else (self.last_progress, now)
                    )
        limit = wd.slow_timeout if now - self.slow_seen <= SLOW_FRESH else wd.hang_timeout
        if now - self.last_progress > limit:
            self._declare(now - self.last_progress, limit)

    def _watch_judge(self) -> None:
        raw = self.wd.client.get_if_set("judge")
        now = time.monotonic()
        beat = json.loads(raw) if raw else {}
        if beat.get("seq") is not None and beat.get("seq") != self.judge.get("seq"):
            self.judge = beat
            self.judge_at = now
        limit = self.wd.slow_timeout if self.judge.get("slow", True) else self.wd.hang_timeout
        if self.judge.get("phase") != "done" and now - self.judge_at > limit:
            # Rank 0 is frozen or gone: this rank reports
            self._declare(now - self.judge_at, limit)

    def _declare(self, stalled: float, limit: float) -> None:
        """Raise the alarm (the first one wins) and answer whichever alarm won."""
        wd = self.wd
        path = wd.log_dir / f"hang-{time.strftime('%Y%m%d-%H%M%S')}.txt"
        alarm = {"kind": "hang", "by": wd.rank, "path": str(path), "stalled": stalled, "limit": limit}
        won = wd.client("compare_set", "alarm", "", json.dumps(alarm)).decode()
        wd._respond(json.loads(won))

    # --- the report ---------------------------------------------------------------------------------

    def serve(self, alarm: dict[str, Any]) -> None:
        """While another rank reports the hang: keep the node's record fresh, post this rank's stacks if they are
        wanted, and exit once the report is done (or after a deadline)."""
        wd = self.wd
        deadline = time.monotonic() + 2 * (GATHER_WAIT + wd.node.poll_period) + 10
        news: dict[str, Any] = {}
        posted = False
        while not news.get("done") and time.monotonic() < deadline:
            news = wd._try(lambda: wd.node.step(wd.beat(), handling=alarm["path"])) or news
            if not posted and wd.rank in (news.get("want") or []):
                posted = wd._try(lambda: wd.client("set", f"stacks/{wd.rank}", thread_stacks()) or True) or False
            time.sleep(0.25)
        fallback = {"summary": f"hang declared by rank {alarm['by']}", "stuck": [], "since": time.time()}
        info = news.get("done") or fallback
        print(
            f"ddpkit: rank {wd.rank}: stopping: {info['summary']}; report: {alarm['path']}", file=sys.stderr, flush=True
        )
        stuck = wd.rank in info["stuck"]
        write_error_file(
            f"{info['summary']} (report: {alarm['path']})",
            when=info["since"] if stuck else time.time(),
            code=HANG_EXIT_CODE,
        )
        wd._try(lambda: wd.client("add", "exited", 1))
        terminate(HANG_EXIT_CODE)

    def report(self, alarm: dict[str, Any]) -> None:
        """Read the nodes' records, gather the suspects' stacks, write and print the report, stop this rank last."""
        wd = self.wd
        beats, silent = self._collect(alarm["path"], wait=True)
        want = self._wanted(classify(beats, silent), beats, silent)
        wd.node.news["want"] = want
        wd._try(lambda: wd.client("set", "want", json.dumps(want)))
        stacks = self._gather(want, alarm["path"])
        # A rank that sent no stacks may have gone stale meanwhile: frozen, not waiting
        if len(stacks) < len(want):
            beats, silent = self._collect(alarm["path"], wait=False)
        beats = self._last_words(silent, stacks, beats)
        verdict = classify(beats, silent)
        stalled = alarm["stalled"]
        text = format_report(verdict, beats, silent, stacks, stalled_for=stalled, limit=alarm["limit"])
        path = write_text(Path(alarm["path"]), text)
        summary = summary_line(verdict, beats, silent, stalled_for=stalled)
        print(f"{text}\nddpkit: {summary}; report: {path}", file=sys.stderr, flush=True)
        hang_start = time.time() - stalled
        stuck = verdict.stuck or verdict.silent
        when = hang_start if wd.rank in stuck else time.time()
        write_error_file(f"{summary} (report: {path})", when=when, code=HANG_EXIT_CODE)
        done = {"summary": summary[:1000], "stuck": stuck, "since": hang_start}
        wd.node.news["done"] = done
        wd._try(lambda: wd.client("set", "done", json.dumps(done)))
        live = len([r for r, b in beats.items() if r not in silent and b.get("phase") != "done"])
        # Let the others exit first: torchrun names the earliest failure
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and int(wd._try(lambda: wd.client("add", "exited", 0)) or 0) < live - 1:
            # The node-mates hear "done"
            wd._try(lambda: wd.node.step(wd.beat(), handling=alarm["path"]))
            time.sleep(0.1)
        # Last, once the others had their 3 s to exit
        self._kill_frozen(verdict.silent, beats, f"{summary} (report: {path})", hang_start)
        terminate(HANG_EXIT_CODE)

    def _collect(self, alarm_id: str, *, wait: bool) -> tuple[dict[int, dict[str, Any]], dict[int, float]]:
        """Every rank's last beat and the silent ranks (-> wall time of their last beat), from the nodes' records;
        with ``wait``, for up to ``GATHER_WAIT`` seconds until every node has answered this alarm."""
        wd = self.wd
        records = {}
        # Nodes poll once a poll period: wait that much longer
        deadline = time.monotonic() + (GATHER_WAIT + wd.node.poll_period if wait else 0.0)
        while True:
            # This rank's node answers too
            wd._try(lambda: wd.node.step(wd.beat(), handling=alarm_id))
            missing = [n for n in range(wd.nodes) if (records.get(n) or {}).get("alarm") != alarm_id]
            records.update(self._read_records(missing))
            if time.monotonic() >= deadline or all((records.get(n) or {}).get("alarm") == alarm_id for n in missing):
                break
            time.sleep(0.25)
        beats: dict[int, dict[str, Any]] = {}
        silent: dict[int, float] = {}
        for n in range(wd.nodes):
            record = records.get(n) or {"t": wd.node.started, "beats": {}, "silent": {}}
            beats.update({int(r): b for r, b in record["beats"].items()})
            silent.update({int(r): t for r, t in record["silent"].items()})
            # The whole node is silent: lost, or its leader frozen with the store
            if record.get("alarm") != alarm_id:
                for rank in range(n * wd.local_world_size, (n + 1) * wd.local_world_size):
                    if (beats.get(rank) or {}).get("phase") != "done":
                        silent.setdefault(rank, min(record["t"], (beats.get(rank) or {}).get("t", record["t"])))
        return beats, silent

    def _read_records(self, nodes: list[int]) -> dict[int, dict[str, Any]]:
        wd = self.wd
        keys = [f"node/{n}" for n in nodes]
        try:
            # All there: one round trip (multi_get waits for missing keys)
            if keys and wd.client("check", keys):
                values = wd.client("multi_get", keys)
            else:
                values = [(raw.encode() if (raw := wd.client.get_if_set(k)) else None) for k in keys]
        except StoreDown:
            return {}
        return {n: json.loads(v) for n, v in zip(nodes, values) if v is not None}

    def _wanted(self, verdict: Verdict, beats: dict[int, dict[str, Any]], silent: dict[int, float]) -> list[int]:
        """Whose stacks the report asks for: every live rank of a small job, else the stuck and a few waiting."""
        live = sorted(r for r, b in beats.items() if r not in silent and b.get("phase") != "done")
        if len(live) <= ALL_STACKS:
            return live
        return sorted(verdict.stuck[:WANT_STUCK] + verdict.waiting[:WANT_WAITING])

    def _gather(self, want: list[int], alarm_id: str) -> dict[int, str]:
        """The stacks the ``want`` ranks post, for up to ``GATHER_WAIT`` seconds (this rank's own at once)."""
        wd = self.wd
        stacks = {}
        if wd.rank in want:
            stacks[wd.rank] = thread_stacks()
        # The leaders poll ``want`` every period
        deadline = time.monotonic() + GATHER_WAIT + wd.node.poll_period
        while time.monotonic() < deadline and len(stacks) < len(want):
            # Relays ``want`` to this node's mates
            wd._try(lambda: wd.node.step(wd.beat(), handling=alarm_id))
            for rank in want:
                if rank not in stacks and (text := wd._try(lambda r=rank: wd.client.get_if_set(f"stacks/{r}"))):
                    stacks[rank] = text
            time.sleep(0.2)
        return stacks

    def _kill_frozen(
        self, silent: list[int], beats: dict[int, dict[str, Any]], summary: str, hang_start: float
    ) -> None:
        """Frozen ranks of this node would hold the job until the agent's SIGKILL (30 s after its SIGTERM): kill
        them now, each with its torchrun error file written for it (the hang's summary, dated to its start)."""
        node = self.wd.node
        for rank in silent:
            beat = beats.get(rank) or {}
            if not node.first <= rank < node.first + node.size or not beat.get("pid"):
                continue
            # A node's ranks are contiguous under torchrun
            local_rank = rank - node.first
            write_error_file(summary, when=hang_start, code=HANG_EXIT_CODE, local_rank=local_rank, pid=int(beat["pid"]))
            if kill_frozen_sibling(int(beat["pid"])):
                print(f"ddpkit: killed frozen rank {rank} (pid {beat['pid']})", file=sys.stderr, flush=True)

    def _last_words(
        self, silent: dict[int, float], stacks: dict[int, str], beats: dict[int, dict[str, Any]]
    ) -> dict[int, dict[str, Any]]:
        """The beats, with each silent rank's own record (:mod:`ddpkit.watchdog.backstop`) of where it stopped, to
        the step (its last beat may be many steps older); its faulthandler dump goes in ``stacks``."""
        beats = dict(beats)
        here = socket.gethostname()
        for rank in silent:
            beat = beats.get(rank) or {}
            found = read_backstop(self.wd.log_dir, rank)
            if found is None:
                elsewhere = f" (look on its host, {beat['host']})" if beat.get("host", here) != here else ""
                where = backstop_path(self.wd.log_dir, rank)
                stacks[rank] = f"(no stacks received from this rank, and no faulthandler dump at {where}{elsewhere})"
                continue
            step, phase, dump = found
            beats[rank] = {**beat, "step": max(step, int(beat.get("step", 0))), "phase": phase}
            stacks[rank] = dump or (
                "(no stacks received from this rank, and faulthandler's timer did not fire in it: "
                "stopped by a signal, or gone)"
            )
        return beats


def report_alone(wd: Any, problem: str, since: float) -> None:
    """The store stopped answering: report rank ``wd.rank`` alone (no other rank can be reached) and exit."""
    beat = wd.beat()
    summary = (
        f"hang: the job's store has not answered since {time.strftime('%H:%M:%S', time.localtime(since))} "
        f"({problem}); it is hosted by rank 0 under `ddpkit run` (else by torchrun's agent on node 0), so rank 0 "
        f"or node 0 is probably frozen or gone. This rank {wd.rank} is at step {beat['step']}, in {beat['phase']}"
    )
    path = wd.log_dir / f"hang-{time.strftime('%Y%m%d-%H%M%S')}-rank{wd.rank}.txt"
    text = f"{summary}\n\n=== rank {wd.rank}: Python stacks of all threads ===\n{thread_stacks()}\n"
    path = write_text(path, text)
    print(f"ddpkit: rank {wd.rank}: stopping: {summary}; report: {path}", file=sys.stderr, flush=True)
    write_error_file(summary, when=time.time(), code=HANG_EXIT_CODE)
    # A node-mate frozen with the store (rank 0 hosting it, SIGSTOPped) would hold the job 30 s more
    node = wd.node
    for index, beat in enumerate(node.board.read(i) for i in range(node.size)):
        if index != node.local and beat and beat.get("pid") and time.time() - beat.get("t", 0.0) > LEADER_STALE:
            write_error_file(summary, when=since, code=HANG_EXIT_CODE, local_rank=index, pid=int(beat["pid"]))
            if kill_frozen_sibling(int(beat["pid"])):
                print(
                    f"ddpkit: killed frozen rank {node.first + index} (pid {beat['pid']})", file=sys.stderr, flush=True
                )
    terminate(HANG_EXIT_CODE)
