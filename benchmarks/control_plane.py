"""The hang watchdog's control plane at scale: the real watchdog code, simulated ranks, a real TCPStore.

    python -m benchmarks.control_plane --ranks 1000                        # before and after, 1,000 ranks
    python -m benchmarks.control_plane --ranks 1000,10000,100000 --ranks-per-node 8 --json cp.json

(From the repository root; a few minutes on 2 cores.) For each world size and scheme, one job: a
TCPStore server in this process (its CPU is the "store CPU" column), the roles that matter run by the
real code in processes of their own, and one process simulating every other rank through the store:

* ``after`` (:mod:`ddpkit.watchdog` of this checkout): rank 0 (judge, leader of node 0), rank
  ``ranks-per-node`` (leader of node 1, the deputy) and the next rank (a plain rank of node 1). The
  simulator writes the other node-mates' beats into the real node boards in ``/dev/shm`` and does what
  every other node's leader does: ``progress`` sets, a record every 5 s, the staggered ``alarm`` polls.
* ``before`` (the watchdog of commit ``BEFORE``, read from git into a temporary package): rank 0 and
  rank 1. The simulator writes every other rank's signed ``hb/<rank>`` once, then rewrites at most
  ``--before-sets`` per interval; "asked" is what the protocol asks (4 calls per rank per interval).

Each role's "training thread" steps every 50 ms until every rank hangs at once. CPU: the role's watchdog
threads (``/proc/self/task/<tid>/schedstat``) over ``--window`` s of steady state; store ops counted at the
calls; ``detect``: from the hang to the ``alarm`` key. The load average is printed with the table.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ddpkit.progress import Progress

BEFORE = "99b7f7eb5a68a31fb2057590fcaccfbf157d5138"  # the last commit of the per-rank heartbeat scheme
PREFIX = "ddpkit/watchdog/1"
INTERVAL, WARMUP = 0.5, 4.0
REPO = Path(__file__).resolve().parent.parent


def _store(port: int) -> Any:
    return dist.TCPStore("127.0.0.1", port, 1, False, datetime.timedelta(seconds=60))


def _thread_cpu(names: tuple[str, ...]) -> float:
    """CPU seconds of this process's threads with these name prefixes (the scheduler's nanoseconds on a CPU)."""
    total = 0.0
    for thread in threading.enumerate():
        if thread.name.startswith(names) and thread.native_id:
            try:
                total += int(Path(f"/proc/self/task/{thread.native_id}/schedstat").read_text().split()[0]) / 1e9
            except (OSError, IndexError, ValueError):
                pass
    return total


def _before_package(tmp: Path) -> Path:
    """The watchdog as it was at ``BEFORE``, importable as ``ddpkit_watchdog_before``."""
    package = tmp / "ddpkit_watchdog_before"
    package.mkdir(parents=True, exist_ok=True)
    for name in ("__init__", "heartbeat", "monitor", "report", "backstop", "store_io"):
        text = subprocess.run(
            ["git", "show", f"{BEFORE}:ddpkit/watchdog/{name}.py"], cwd=REPO, check=True, capture_output=True, text=True
        ).stdout
        (package / f"{name}.py").write_text(text.replace("ddpkit.watchdog.", "ddpkit_watchdog_before."))
    return tmp


def _load_before(package: Path) -> None:
    """Make ``ddpkit_watchdog_before`` importable from ``package`` (the import path itself is left alone)."""
    spec = importlib.util.spec_from_file_location(
        package.name, package / "__init__.py", submodule_search_locations=[str(package)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[package.name] = module
    spec.loader.exec_module(module)


def _role(scheme: str, rank: int, args: dict[str, Any], out: str, clock: Any, ready: Any) -> None:
    """One real watchdog: train (a step every 50 ms) until the hang, measure its threads, then hang."""
    os.environ["DDPKIT_JOB_SECRET"] = args["secret"]
    if scheme == "before":
        _load_before(Path(args["before"]))
        import ddpkit_watchdog_before.heartbeat as heartbeat
        from ddpkit_watchdog_before.store_io import StoreClient
    else:
        import ddpkit.watchdog.heartbeat as heartbeat
        from ddpkit.watchdog.store_io import StoreClient
    ops = [0]
    call = StoreClient._call

    def counted(self: Any, method: str, *rest: Any) -> Any:
        ops[0] += 1
        return call(self, method, *rest)

    StoreClient._call = counted
    progress = Progress()
    # The scheme before read the step through a callable; today's watchdog holds the loop's counter.
    extra = (
        {"step": lambda: progress.step}
        if scheme == "before"
        else {"local_world_size": args["rpn"], "progress": progress}
    )
    wd = heartbeat.Watchdog(
        _store(args["port"]),
        rank=rank,
        world_size=args["ranks"],
        hang_timeout=args["hang"],
        slow_timeout=args["hang"],
        log_dir=Path(out).parent / f"logs-{rank}",
        **extra,
    ).start()
    wd.on_phase("data")
    ready.put(rank)
    measured: dict[str, float] = {}
    while clock[0] == 0 or time.time() < clock[0]:  # the hang's time, once every process is ready
        for phase in ("forward", "backward", None, None):
            wd.on_phase(phase)
        progress.step += 1
        now = time.time()
        if not measured and clock[0] and now >= clock[0] - args["window"] - 0.5:
            measured = {"cpu": _thread_cpu(("ddpkit-watchdog",)), "ops": ops[0], "t": now}
        elif measured and "window" not in measured and now >= measured["t"] + args["window"]:
            cpu, n = _thread_cpu(("ddpkit-watchdog",)) - measured["cpu"], ops[0] - measured["ops"]
            measured.update(window=now - measured["t"], cpu_s=cpu, ops_n=n)
            Path(out).write_text(json.dumps(measured))
        wd.on_phase("data")
        time.sleep(0.05)
    threading.Event().wait()  # every rank hangs here; the watchdog ends the process (or the driver does)


def _simulate(scheme: str, args: dict[str, Any], out: str, clock: Any, ready: Any) -> None:
    """Every rank that is not a real role, through the same store (and the real node boards, after)."""
    os.environ.pop("DDPKIT_JOB_SECRET", None)
    store = dist.PrefixStore(PREFIX, _store(args["port"]))
    key = args["secret"].encode()
    work = _SimAfter(store, key, args) if scheme == "after" else _SimBefore(store, key, args)
    tick, counts = 0, {"sets": 0, "round_trips": 0, "late": 0}
    ready.put("sim")
    start = time.time()
    while clock[1] == 0 or time.time() < clock[1]:
        tick += 1
        training = clock[0] == 0 or time.time() < clock[0]
        if not training and "intervals" not in counts:  # the steady state's counts, before the hang
            counts["intervals"] = tick - 1
            Path(out).write_text(json.dumps(counts))
        work.interval(tick, training, counts)
        delay = start + tick * INTERVAL - time.time()
        if delay > 0:
            time.sleep(delay)
        else:
            counts["late"] += 1


class _SimAfter:
    """The other nodes' leaders (progress, node records, alarm polls) and the real nodes' other mates."""

    def __init__(self, store: Any, key: bytes, args: dict[str, Any]):
        from ddpkit.distributed.control_auth import sign
        from ddpkit.watchdog.node import POLLS_PER_SECOND, RECORD_EVERY, SETS_PER_SECOND
        from ddpkit.watchdog.node_board import NodeBoard, board_name

        self.store, rpn = store, args["rpn"]
        self.nodes = args["ranks"] // rpn
        self.poll_every = max(1, math.ceil(self.nodes / (POLLS_PER_SECOND * INTERVAL)))
        self.record_every = int(RECORD_EVERY / INTERVAL)
        self.set_every = 2 if self.nodes > SETS_PER_SECOND * INTERVAL else 1
        self.progress = [[sign(key, "progress", f"{n}:{i}") for i in (0, 1)] for n in range(self.nodes)]
        now = time.time()
        record = {"host": "sim", "t": now, "alarm": None, "silent": {}}  # a node's record, as its leader sets it
        self.records = [
            sign(
                key,
                f"node/{n}",
                json.dumps(
                    {
                        **record,
                        "node": n,
                        "beats": {n * rpn + i: {**_beat(n * rpn + i, 1), "t": now} for i in range(rpn)},
                    }
                ),
            )
            for n in range(self.nodes)
        ]
        real = {(0, 0), (1, 0), (1, 1)}
        self.boards = [
            NodeBoard.open(board_name(key, PREFIX, node=n), slots=rpn, index=i)
            for n in (0, 1)
            for i in range(rpn)
            if (n, i) not in real
        ]
        self.step = 0

    def interval(self, tick: int, training: bool, counts: dict[str, int]) -> None:
        self.step += training
        for board in self.boards:
            board.write({**_beat(board.index, self.step), "t": time.time()})
        for n in range(2, self.nodes):
            if training and (tick + n) % self.set_every == 0:
                self.store.set("progress", self.progress[n][tick % 2])
                counts["sets"] += 1
            if (tick + n) % self.poll_every == 0:
                self.store.check(["alarm"])
                counts["round_trips"] += 1
            if (tick + n) % self.record_every == 0:
                self.store.set(f"node/{n}", self.records[n])
                counts["sets"] += 1


class _SimBefore:
    """Every other rank's ``hb/<rank>``, written once, then as many rewritten per interval as the budget allows."""

    def __init__(self, store: Any, key: bytes, args: dict[str, Any]):
        from ddpkit.distributed.control_auth import sign

        self.store, self.ranks, self.budget = store, args["ranks"], args["before_sets"]
        self.values = {
            r: [sign(key, f"hb/{r}", json.dumps({**_beat(r, s), "seq": s})) for s in (1, 2)]
            for r in range(2, self.ranks)
        }
        for rank, pair in self.values.items():
            store.set(f"hb/{rank}", pair[0])
        self.next = 2

    def interval(self, tick: int, training: bool, counts: dict[str, int]) -> None:
        if not training:
            return  # hung: nothing changes (the real ranks' beats do not either)
        for _ in range(min(self.budget, self.ranks - 2)):
            rank = self.next
            self.next = 2 + (self.next - 1) % (self.ranks - 2)
            self.store.set(f"hb/{rank}", self.values[rank][tick % 2])
            counts["sets"] += 1


def _beat(rank: int, step: int) -> dict[str, Any]:
    return {
        "rank": rank,
        "seq": step,
        "step": step,
        "phase": "forward",
        "ticks": 4 * step,
        "phase_ticks": 0,
        "novel": 0,
        "since": time.time(),
        "host": "sim",
        "pid": 0,
        "slow": False,
    }


def run_one(scheme: str, ranks: int, rpn: int, opts: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """One simulated job: the store, the real roles, the simulator; the measurements and the detection time."""
    from ddpkit.distributed.control_auth import new_secret

    ctx = multiprocessing.get_context("spawn")
    server = dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=60), wait_for_workers=False)
    roles = {"rank 0": 0, "plain": 1} if scheme == "before" else {"rank 0": 0, "leader": rpn, "plain": rpn + 1}
    clock, ready = ctx.Array("d", 2), ctx.Queue()  # the hang's time and the end's, once every process is ready
    args = {
        "port": server.port,
        "ranks": ranks,
        "rpn": rpn,
        "hang": opts.hang_timeout,
        "secret": new_secret(),
        "window": opts.window,
        "before_sets": opts.before_sets,
        "before": str(tmp / "ddpkit_watchdog_before"),
    }
    run_dir = Path(tempfile.mkdtemp(prefix=f"{scheme}-{ranks}-", dir=tmp))
    procs = [
        ctx.Process(target=_role, args=(scheme, rank, args, str(run_dir / f"{name}.json"), clock, ready), daemon=True)
        for name, rank in roles.items()
    ]
    procs.append(
        ctx.Process(target=_simulate, args=(scheme, args, str(run_dir / "sim.json"), clock, ready), daemon=True)
    )
    for proc in procs:
        proc.start()
    for _ in procs:
        ready.get(timeout=600)
    hang_at = time.time() + WARMUP + opts.window + 1
    clock[0], clock[1] = hang_at, hang_at + opts.hang_timeout + 40
    store_cpu = _watch(server, hang_at, clock[1])
    detect = store_cpu.pop("detect")
    for proc in procs:
        proc.kill()
        proc.join()
    results = {"scheme": scheme, "ranks": ranks, "nodes": ranks // rpn, "detect_s": detect, **store_cpu}
    for name in [*roles, "sim"]:
        path = run_dir / f"{name}.json"
        results[name] = json.loads(path.read_text()) if path.exists() else None
    return results


def _watch(server: Any, hang_at: float, stop_at: float) -> dict[str, Any]:
    """The store server's CPU share before the hang, then the time from the hang to the ``alarm`` key."""
    store = dist.PrefixStore(PREFIX, server)
    while time.time() < hang_at - 2 - 10:
        time.sleep(0.2)
    first = time.process_time(), time.time()  # this process hosts the server: its C++ threads are this process
    time.sleep(10)
    share = (time.process_time() - first[0]) / (time.time() - first[1])
    while time.time() < hang_at:
        time.sleep(0.05)
    while time.time() < stop_at:
        if store.check(["alarm"]):
            return {"detect": time.time() - hang_at, "store_cpu": share}
        time.sleep(0.05)
    return {"detect": None, "store_cpu": share}


def _capacity_client(port: int, method: str, seconds: float, queue: Any) -> None:
    store, n = _store(port), 0
    end, value = time.monotonic() + seconds, b"x" * 150
    while time.monotonic() < end:
        for _ in range(100):
            store.set(f"k{n % 1000}", value) if method == "set" else store.check(["k0"])
            n += 1
    queue.put(n)


def capacity(seconds: float = 3.0, clients: int = 3) -> dict[str, float]:
    """What the store takes here: sets/s (not waited for) and round trips/s (``check``), from ``clients`` processes."""
    server = dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=60), wait_for_workers=False)
    server.set("k0", "0")
    ctx, out = multiprocessing.get_context("spawn"), {}
    for method in ("set", "check"):
        queue = ctx.Queue()
        procs = [
            ctx.Process(target=_capacity_client, args=(server.port, method, seconds, queue)) for _ in range(clients)
        ]
        for proc in procs:
            proc.start()
        out[method] = sum(queue.get() for _ in procs) / seconds
        for proc in procs:
            proc.join()
    return {"sets_per_s": out["set"], "round_trips_per_s": out["check"]}


def _row(r: dict[str, Any]) -> str:
    def share(name: str) -> str:
        return f"{100 * r[name]['cpu_s'] / r[name]['window']:.2f}%" if r.get(name) else "-"

    def ops(name: str) -> float:
        return r[name]["ops_n"] / r[name]["window"] if r.get(name) else 0.0

    sim = r.get("sim") or {}
    driven = (sim.get("sets", 0) + sim.get("round_trips", 0)) / max(1, sim.get("intervals", 1)) / INTERVAL
    driven += sum(ops(name) for name in ("rank 0", "leader", "plain"))
    # before, each rank: set hb, check alarm, check + get hb/0 (rank 0: the multi_get)
    asked = 4 * r["ranks"] / INTERVAL if r["scheme"] == "before" else driven
    detect = f"{r['detect_s']:.1f}" if r["detect_s"] is not None else "none"
    return (
        f"| {r['scheme']} | {r['ranks']:,} | {asked:,.0f} | {driven:,.0f} | {100 * r['store_cpu']:.0f}% | "
        f"{share('rank 0')} ({ops('rank 0') * INTERVAL:.1f}) | {share('leader')} "
        f"({ops('leader') * INTERVAL:.1f}) | {share('plain')} ({ops('plain') * INTERVAL:.1f}) | {detect} | "
        f"{sim.get('late', '-')} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.control_plane", description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", default="1000", help="world sizes, comma-separated (default 1000)")
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--schemes", default="before,after", help="before, after or both (default)")
    parser.add_argument("--hang-timeout", type=float, default=5.0, help="dist.hang_timeout of the run (default 5)")
    parser.add_argument("--window", type=float, default=10.0, help="seconds of steady state measured (default 10)")
    parser.add_argument("--before-sets", type=int, default=4000, help="hb rewrites per interval, before (default 4000)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    opts = parser.parse_args(argv)
    sizes, schemes = [int(s) for s in opts.ranks.split(",")], opts.schemes.split(",")
    if opts.ranks_per_node < 2 or any(n % opts.ranks_per_node or n < 2 * opts.ranks_per_node for n in sizes):
        parser.error(f"--ranks {opts.ranks}: each must be a multiple of --ranks-per-node, and at least two nodes")
    load = os.getloadavg()
    cap = capacity()
    print(
        f"store capacity here: {cap['sets_per_s']:,.0f} sets/s, {cap['round_trips_per_s']:,.0f} round trips/s; "
        f"load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
        flush=True,
    )
    results = []
    with tempfile.TemporaryDirectory(prefix="control-plane-") as tmp:
        if "before" in schemes:
            _before_package(Path(tmp))
        for ranks in sizes:
            for scheme in schemes:
                results.append(run_one(scheme, ranks, opts.ranks_per_node, opts, Path(tmp)))
                print(json.dumps(results[-1]), flush=True)
    print(
        f"\nhang_timeout {opts.hang_timeout:g} s, {opts.ranks_per_node} ranks per node, interval {INTERVAL} s; "
        f"load after {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print(
        "| scheme | ranks | store ops/s asked | ops/s driven | store CPU | rank 0 CPU (ops/interval) | "
        "node leader | plain rank | detect s | late intervals |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(_row(r))
    if opts.json:
        opts.json.write_text(json.dumps({"capacity": cap, "load_before": load, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
