"""The watchdog's control plane: a node's board in shared memory, its leader, rank 0's two keys.

Fast checks in one process on an in-memory store (the real fault cases, on real processes, are in
tests/test_watchdog.py): what a rank writes into its slot its leader reads, a torn write is never
read, the next local rank leads when the first stops beating and the node's news reaches every
rank, rank 0 judges from ``progress`` and ``slow`` alone, and the store calls per heartbeat of rank 0,
a node leader and a plain rank are the same at 16 ranks and at 100,000.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from typing import Any

import pytest
import torch.distributed as dist

from ddpkit.watchdog.heartbeat import Watchdog
from ddpkit.watchdog.node import LEADER_STALE, Node
from ddpkit.watchdog.node_board import NodeBoard
from ddpkit.watchdog.store_io import StoreClient

KEY = b"k" * 64


def boards(n: int) -> list[NodeBoard]:
    name = f"ddpkit-test-{uuid.uuid4().hex}"
    return [NodeBoard.open(name, slots=n, index=i) for i in range(n)]


def test_what_a_rank_writes_its_leader_reads_and_a_torn_write_is_never_read():
    leader, mate = boards(2)
    try:
        assert leader.read(1) is None
        mate.write({"step": 3, "phase": "forward"})
        assert leader.read(1) == {"step": 3, "phase": "forward"}
        mate.write({"step": 4, "phase": "backward"})
        leader.page[4096 + 16] = ord("X")  # a byte of the payload changed under its checksum: caught mid-write
        assert leader.read(1) == {"step": 3, "phase": "forward"}  # the last good value, not garbage
        leader.relay({"alarm": {"kind": "hang"}})
        assert mate.relayed(0) == {"alarm": {"kind": "hang"}} and mate.relayed(1) == {}
        assert leader.path.exists()
        leader.write({"step": 4})
        leader.forget_file()  # every slot written: nobody opens the file again
        assert not leader.path.exists() and leader.read(1) is not None  # the mapping stays
    finally:
        for board in (leader, mate):
            board.close()


def beat(step: int, *, t: float | None = None, phase: str = "forward") -> dict[str, Any]:
    return {"step": step, "phase": phase, "ticks": step, "novel": 0, "slow": False, "pid": 1, "t": t or time.time()}


def test_the_next_local_rank_leads_when_the_first_stops_and_the_news_reaches_every_rank():
    store = dist.HashStore()
    client = StoreClient(store, 5.0, key=KEY)
    nodes = [
        Node(board, client, rank=4 + i, local_world_size=4, nodes=2, interval=0.5) for i, board in enumerate(boards(4))
    ]
    try:
        for node in nodes:
            node.step(beat(1))
        assert [n.leading for n in nodes] == [True, False, False, False]
        nodes[0].step(beat(2))
        assert nodes[0].progressed and client.get_if_set("progress") == "1:2"  # node 1, its second turn
        assert json.loads(client.get_if_set("node/1"))["node"] == 1  # its record (every 5 s; the first at once)
        beats, silent = nodes[0].survey(time.time())
        assert sorted(beats) == [4, 5, 6, 7] and silent == {}
        client("compare_set", "alarm", "", json.dumps({"kind": "hang", "by": 0}))
        nodes[0].step(beat(2))  # polls the alarm and relays it
        assert all(n.step(beat(2))["alarm"]["by"] == 0 for n in nodes[1:])
        stale = time.time() - LEADER_STALE - 1
        nodes[0].board.write(beat(2, t=stale))  # local rank 0 stops beating (frozen, say)
        assert nodes[1].step(beat(2))["alarm"]["by"] == 0 and nodes[1].leading  # takes over, keeps the news
        assert nodes[1].took_over_at == pytest.approx(stale) and not nodes[2].step(beat(2)) == {}
        assert not nodes[2].leading
    finally:
        client.close()
        for node in nodes:
            node.board.close()


class Counted(StoreClient):
    calls = 0

    def _call(self, method: str, *args: Any) -> Any:
        Counted.calls += 1
        return super()._call(method, *args)


def roles(world_size: int, tmp_path, monkeypatch) -> dict[str, Watchdog]:
    """Rank 0, the leader of node 1 and a plain rank of node 1, started without their threads."""
    import ddpkit.watchdog.heartbeat as heartbeat

    monkeypatch.setattr(heartbeat, "StoreClient", Counted)
    store, out = dist.HashStore(), {}
    for name, rank in {"rank 0": 0, "leader": 8, "plain": 9}.items():
        heartbeat._generation = 0  # one job: the same key prefix and boards for the three
        wd = Watchdog(
            store,
            rank=rank,
            world_size=world_size,
            hang_timeout=60,
            slow_timeout=60,
            log_dir=tmp_path / name,
            local_world_size=8,
        )
        wd.client.key = KEY
        wd._thread = threading.Thread(target=lambda: None)  # the test drives the beats
        out[name] = wd.start()
    return out


@pytest.mark.parametrize("world_size", [16, 100_000])
def test_store_calls_per_heartbeat_do_not_grow_with_the_job(world_size, tmp_path, monkeypatch):
    wds = roles(world_size, tmp_path, monkeypatch)
    calls: dict[str, int] = {}
    try:
        for name, wd in wds.items():
            Counted.calls = 0
            for _ in range(20):
                wd.node.step(wd.beat())
                wd._monitor.check()
            calls[name] = Counted.calls
    finally:
        for wd in wds.values():
            wd.stop()
    assert calls["plain"] == 0  # a plain rank beats into shared memory only
    assert calls["rank 0"] <= 20 * 6 and calls["leader"] <= 20 * 5, calls  # a few per beat, whatever the size


def test_rank_0_judges_from_progress_and_slow_alone(tmp_path, monkeypatch):
    wds = roles(16, tmp_path, monkeypatch)
    judge, declared = wds["rank 0"], []
    monkeypatch.setattr(judge._monitor, "_declare", lambda stalled, limit: declared.append(limit))
    judge.hang_timeout, judge.slow_timeout = 0.3, 0.9
    try:
        judge.node.step(judge.beat())
        judge._monitor.check()
        for turn in range(3):  # another node keeps making progress: no alarm
            time.sleep(0.2)
            judge.client("set", "progress", f"1:{turn}")
            judge._monitor.check()
        assert not declared
        time.sleep(0.4)
        judge.client("set", "slow", "1:9")  # a rank in a slow phase (a checkpoint): the slow limit
        judge._monitor.check()
        assert not declared
        time.sleep(0.6)
        judge._monitor.check()
        assert declared == [0.9]
    finally:
        for wd in wds.values():
            wd.stop()


def test_a_report_on_100000_ranks_names_a_few_and_shows_the_stacks_it_has():
    from ddpkit.watchdog.report import classify, format_report, summary_line

    beats = {r: {"step": 7, "phase": "backward", "since": time.time(), "host": "h", "pid": r} for r in range(100_000)}
    beats[31_337] = {**beats[31_337], "phase": "forward"}
    verdict = classify(beats, silent={})
    line = summary_line(verdict, beats, {}, stalled_for=20)
    assert "stuck: rank 31337 (step 7, forward)" in line and "waiting: rank 0, rank 1" in line
    assert line.endswith("and 99991 more") and len(line) < 400
    text = format_report(verdict, beats, {}, {31_337: "Thread MainThread ...", 0: "..."}, stalled_for=20, limit=15)
    assert text.count("=== rank") == 2 and "(99998 other ranks: no stacks asked for" in text
