"""Can a Gloo survivor keep its process? One rank is SIGKILLed; the other catches the error, rebuilds its group.

    .venv/bin/python -m benchmarks.inprocess_recovery          # prints the survivor's timings (docs/goodput.md)

Two ranks train a small DDP MLP over a ``FileStore``; rank 1 SIGKILLs itself at its 21st step. Rank 0 (this
process) keeps its process: it catches the collective's error, drops DDP and the optimizer, destroys its process
group, forms a new one (a new store file) with a replacement rank 1, re-wraps the model in DDP and broadcasts
its weights to the replacement (what a checkpoint on disk does for a restart). Printed: how long after the kill
the survivor saw the error, how long the destroy took, and from the error to the first backward in the new
group. The replacement is a new interpreter (``spawn``), so its start-up dominates that last figure; what the
survivor itself saves, compared with a restart, is its own start-up: process group, data, model and load.

This is not what ``ddpkit run`` does: torch's agent stops every worker of a failed group (see docs/goodput.md,
"Keeping the survivors alive").
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

KILL_AT = 20


def _group(store_dir: str, name: str, rank: int) -> None:
    store = dist.FileStore(os.path.join(store_dir, name), 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))


def _victim(store_dir: str) -> None:
    _group(store_dir, "round0", 1)
    model = nn.parallel.DistributedDataParallel(_model())
    for step in range(10**6):
        model(torch.randn(32, 64)).sum().backward()
        if step == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)


def _replacement(store_dir: str, out: Any) -> None:
    began = time.time()
    _group(store_dir, "round1", 1)
    model = nn.parallel.DistributedDataParallel(_model())
    for tensor in model.module.state_dict().values():
        dist.broadcast(tensor, 0)
    model(torch.randn(32, 64)).sum().backward()
    out.put(time.time() - began)


def _train_until_the_peer_dies(store_dir: str) -> tuple[dict[str, torch.Tensor], float]:
    _group(store_dir, "round0", 0)
    model = nn.parallel.DistributedDataParallel(_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        while True:
            model(torch.randn(32, 64)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    except RuntimeError as exc:
        print(f"survivor: the collective raised {str(exc).splitlines()[0][:90]}...")
        return {k: v.clone() for k, v in model.module.state_dict().items()}, time.time()


def main() -> None:
    ctx, store_dir = mp.get_context("spawn"), tempfile.mkdtemp(prefix="inprocess-")
    victim = ctx.Process(target=_victim, args=(store_dir,))
    victim.start()
    state, error_at = _train_until_the_peer_dies(store_dir)
    victim.join()
    began = time.time()
    dist.destroy_process_group()
    destroyed = time.time() - began
    out = ctx.Queue()
    replacement = ctx.Process(target=_replacement, args=(store_dir, out))
    replacement.start()
    _group(store_dir, "round1", 0)
    model = _model()
    model.load_state_dict(state)
    ddp = nn.parallel.DistributedDataParallel(model)
    for tensor in ddp.module.state_dict().values():
        dist.broadcast(tensor, 0)
    ddp(torch.randn(32, 64)).sum().backward()
    print(
        f"survivor: victim exit code {victim.exitcode}; destroy_process_group {destroyed:.3f} s; from the error to "
        f"the first backward in the new group {time.time() - error_at:.3f} s; the replacement, from its start to its "
        f"first backward {out.get():.3f} s"
    )
    replacement.join()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
