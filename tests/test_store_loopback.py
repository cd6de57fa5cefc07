"""A one-node ``ddpkit run`` listens on loopback only: its rendezvous store, rank 0's store, Gloo.

Fast checks: torchrun's argv for one node, and the loopback store alone (read back from
``/proc/net/tcp``). The real check pauses a 2-rank ``ddpkit run`` (new interpreters, so the job's
secret also crosses torchrun's environment) and reads the listening sockets of every process of
its tree from ``/proc``.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path

import pytest
from helpers import finish, start_gated_run

from ddpkit.distributed.rendezvous import is_loopback, loopback_store
from ddpkit.launch.launcher import torchrun_argv

pytestmark = pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc/net/tcp (Linux)")


def _address(hex_addr: str) -> str:
    """``0100007F:1F90`` (or 32 hex digits for IPv6, in 4 little-endian words) -> ``127.0.0.1``."""
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    return str(ipaddress.IPv6Address(b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))))


def listening() -> dict[str, tuple[str, int]]:
    """socket inode -> (address, port) of every listening TCP socket in this network namespace."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                addr, port = fields[1].rsplit(":", 1)
                found[fields[9]] = (_address(addr), int(port, 16))
    return found


def sockets_of(pids: set[int]) -> set[str]:
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    return inodes


def process_tree(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        tree.add(pid)
        todo += children.get(pid, [])
    return tree


def test_one_node_argv_asks_for_the_loopback_rendezvous():
    argv = torchrun_argv(nproc="2", program=["-m", "ddpkit", "train", "x.yaml"])
    assert (
        "--rdzv-backend=ddpkit-loopback" in argv
        and "--rdzv-endpoint=127.0.0.1:0" in argv
        and "--local-addr=127.0.0.1" in argv
    )
    assert "--standalone" not in argv
    two_nodes = torchrun_argv(nproc="2", program=["x.py"], nnodes="2", rdzv_endpoint="node0:29400")
    assert "--rdzv-backend=c10d" in two_nodes and not any("loopback" in a or "local-addr" in a for a in two_nodes)
    assert all(map(is_loopback, ["127.0.0.1", "127.0.1.1", "::1", "[::1]", "localhost"]))
    assert not any(map(is_loopback, ["10.0.0.5", "node0", "0.0.0.0", ""]))


def test_the_loopback_store_listens_on_loopback_only():
    store = loopback_store(0, timeout=10)
    mine = {inode: where for inode, where in listening().items() if where[1] == store.port}
    assert mine and set(mine.values()) == {("127.0.0.1", store.port)}, mine
    store.set("k", "v")
    assert store.get("k") == b"v"
    with socket.create_connection(("127.0.0.1", store.port), timeout=5):
        pass


def test_a_one_node_run_listens_on_loopback_only(tmp_path):
    """It reads the sockets of every process of a real `ddpkit run` tree, the launcher's rendezvous store included."""
    launcher, ready = start_gated_run(tmp_path, "--worker-start", "subprocess")
    try:
        table = listening()
        pids = process_tree(launcher.pid)
        ours = {table[inode] for inode in sockets_of(pids) if inode in table}
    finally:
        output = finish(launcher, tmp_path)
    assert launcher.returncode == 0, output[-4000:]
    assert ("127.0.0.1", ready["port"]) in ours and len(ours) >= 2, ours  # rank 0's store, the rendezvous store, Gloo's
    assert all(ipaddress.ip_address(addr).is_loopback for addr, _ in ours), ours
    assert "without a valid ddpkit tag" not in output  # the secret reached new interpreters through torchrun
