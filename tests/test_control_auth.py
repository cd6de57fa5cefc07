"""Tags on ddpkit's control messages in the job's store (ddpkit.distributed.control_auth).

Fast checks need no process group: sign/verify, the store client and the stop request on an
in-memory store with values written "by someone else". A 2-rank check agrees on one key over the
group. The end-to-end check runs a real ``ddpkit run`` while another local process connects to
rank 0's store and writes a stop request and a hang alarm: the run must finish as if nothing happened.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import time

import pytest
import torch.distributed as dist
from helpers import finish, run_in_pool, start_gated_run

from ddpkit.checkpoint.preemption import StopOnSignal
from ddpkit.distributed import control_auth
from ddpkit.distributed.control_auth import job_key, read_signed, sign, verify
from ddpkit.watchdog.store_io import StoreClient, StoreDown

KEY, OTHER = b"k" * 64, b"o" * 64


def test_a_signed_value_verifies_and_anything_else_does_not():
    raw = sign(KEY, "hb/1", '{"step": 12}')
    assert verify(KEY, "hb/1", raw) == '{"step": 12}' and verify(KEY, "hb/1", raw.decode()) == '{"step": 12}'
    assert verify(KEY, "hb/1", raw.replace(b"12", b"13")) is None  # tampered value
    assert verify(OTHER, "hb/1", raw) is None  # another job's key
    assert verify(KEY, "hb/0", raw) is None  # moved to another key
    assert verify(KEY, "hb/1", b'{"step": 12}') is None  # no tag
    assert (
        verify(KEY, "hb/1", raw[:64]) is None and verify(KEY, "hb/1", b"") is None and verify(KEY, "hb/1", None) is None
    )
    assert verify(KEY, "x", sign(KEY, "x", "")) == ""


def test_a_rejected_message_is_logged_once_per_kind_of_key(caplog):
    control_auth._logged.clear()
    with caplog.at_level(logging.WARNING, logger="ddpkit"):
        for rank in range(3):
            assert read_signed(KEY, f"hb/{rank}", b"forged by another local process") is None
        assert read_signed(KEY, "alarm", b'{"kind": "hang"}') is None
        assert read_signed(KEY, "alarm", sign(KEY, "alarm", "ok")) == "ok" and read_signed(KEY, "alarm", None) is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert (
        "key 'hb/0', value b'forged by another local process'" in lines[0]
        and "someone else wrote to the job's store" in lines[0]
    )
    assert "key 'alarm'" in lines[1] and KEY.decode() not in "".join(lines)


def test_the_store_client_signs_what_it_sets_and_ignores_what_it_did_not():
    store = dist.HashStore()
    client = StoreClient(store, 5.0, key=KEY)
    try:
        client("set", "hb/0", "beat")
        assert store.get("hb/0") == sign(KEY, "hb/0", "beat") and client.get_if_set("hb/0") == "beat"
        store.set("hb/1", "forged")
        assert client.get_if_set("hb/1") is None and client("multi_get", ["hb/0", "hb/1"]) == [b"beat", None]
        store.set("alarm", json.dumps({"kind": "hang", "by": 1, "path": "/tmp/x", "stalled": 1, "limit": 1}))
        assert client.get_if_set("alarm") is None
        assert client("compare_set", "alarm", "", "mine") == b"mine"  # the forged alarm does not keep the real one out
        assert client("compare_set", "alarm", "", "second") == b"mine"  # the first real alarm still wins
        assert verify(KEY, "alarm", store.get("alarm")) == "mine"
    finally:
        client.close()


def test_a_key_that_someone_keeps_overwriting_is_a_store_failure():
    class Hostile(dist.HashStore):
        def compare_set(self, key, expected, desired):  # noqa: ANN001
            return b"forged again"

    client = StoreClient(Hostile(), 5.0, key=KEY)
    try:
        with pytest.raises(StoreDown, match="keeps being overwritten"):
            client("compare_set", "alarm", "", "mine")
    finally:
        client.close()


def test_a_forged_stop_request_is_ignored_and_a_signed_one_is_followed(monkeypatch):
    monkeypatch.setattr(control_auth, "_key", KEY)
    store = dist.HashStore()
    # no signals, no thread: the store protocol alone
    stop = StopOnSignal([], store=store, rank=1, world_size=2, key=job_key())
    try:
        store.set("ddpkit/stop/request", "rank 0 received SIGTERM")
        assert stop._store.check(["request"]) and stop._read("request") is None
        store.set("ddpkit/stop/request", sign(KEY, "request", "rank 0 received SIGTERM"))
        assert stop._read("request") == "rank 0 received SIGTERM"
        # the proposals: a forged one counts as not made, until its rank writes it again
        stop.requested = True
        store.set("ddpkit/stop/proposal/0", "999")
        store.add("ddpkit/stop/proposals", 1)
        assert stop.agreed(5) is False and stop.stop_step is None
        store.set("ddpkit/stop/proposal/0", sign(KEY, "proposal/0", "4"))
        assert stop.agreed(5) is False and stop.stop_step == 6 and stop.agreed(6)  # max(4, 5) + 1
        assert stop.describe() == "rank 0 received SIGTERM"
    finally:
        stop.close()


def _agreed_key(secrets: list[str | None]) -> tuple[str, bool]:
    rank = dist.get_rank()
    control_auth._key = None
    os.environ.pop(control_auth.SECRET_ENV, None)
    if secrets[rank] is not None:
        os.environ[control_auth.SECRET_ENV] = secrets[rank]
    key = control_auth.agree_job_key()
    return key.decode(), control_auth.SECRET_ENV in os.environ


def test_the_ranks_agree_on_one_key_over_the_group():
    same = run_in_pool(_agreed_key, 2, args=(["a" * 64, "a" * 64],), timeout=60)
    assert same == [("a" * 64, False)] * 2  # the launcher's secret, removed from the environment once read
    for secrets in (["a" * 64, "b" * 64], [None, None], ["a" * 64, None]):
        keys = run_in_pool(_agreed_key, 2, args=(secrets,), timeout=60)
        assert keys[0] == keys[1] and len(keys[0][0]) == 64 and keys[0][0] not in secrets, secrets


# --- a real run while another process writes to its store ----------------------------------------

FORGED_ALARM = json.dumps({"kind": "hang", "by": 1, "path": "/tmp/forged-hang.txt", "stalled": 99.0, "limit": 1.0})


def test_another_process_writing_to_the_jobs_store_changes_nothing(tmp_path):
    """The intruder is another process connecting to the store of a real `ddpkit run`, whose ranks hold the secret the
    launcher put in their environment."""
    launcher, ready = start_gated_run(tmp_path)
    intruder = dist.TCPStore("127.0.0.1", ready["port"], is_master=False, timeout=datetime.timedelta(seconds=10))
    intruder.set("ddpkit/stop/request", "rank 0 received SIGTERM")  # the exact keys ddpkit uses
    for generation in (1, 2):
        intruder.set(f"ddpkit/watchdog/{generation}/alarm", FORGED_ALARM)
        intruder.set(f"ddpkit/watchdog/{generation}/hb/0", json.dumps({"rank": 0, "seq": 1, "phase": "done"}))
    time.sleep(2.0)  # the stop poll (0.1 s) and the watchdog (0.5 s) read them several times meanwhile
    del intruder
    output = finish(launcher, tmp_path)
    assert launcher.returncode == 0, output[-4000:]
    run = tmp_path / "run"
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines() if '"step"' in line]
    assert max(steps) == 2 * 256 // 32 and (run / "model.pt").is_file()  # every step: 8 per epoch, 2 epochs
    assert "stopped" not in output and not list((run / "logs").glob("hang-*"))
    ignored = [line for line in output.splitlines() if "without a valid ddpkit tag" in line]
    for key in ("'request'", "'alarm'"):
        named = [line for line in ignored if f"key {key}" in line]
        # once per rank at most
        assert named and len(named) == len({line.split("]")[0] for line in named}), (key, ignored)
    assert "rank 0 received SIGTERM" in "".join(ignored) and control_auth.SECRET_ENV not in output
