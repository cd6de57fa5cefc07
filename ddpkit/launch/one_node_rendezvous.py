"""The rendezvous of a one-node ``ddpkit run``: one agent, so nothing to agree on and nothing to wait for.

    handler = OneNodeRendezvous(loopback_store(0), run_id="...", backend="ddpkit-loopback", info=round_info)
    info = handler.next_rendezvous()    # round 1: rank 0 of 1, a fresh key space, a free port for the workers' store

torchrun's one-node default (``--standalone``) is the c10d rendezvous of a multi-node job, run by one agent
alone: its first round, and the first restart after it, sleep a random 0 to 0.3 s "to skew the rendezvous
attempts across the nodes" (``DynamicRendezvousHandler.next_rendezvous``), and every tick of the agent's monitor
asks the store whether another node waits to join. One node has no other to skew from or wait for: this
handler completes each round at once, on a store that listens on loopback only
(:func:`ddpkit.distributed.rendezvous.loopback_store`), with a key space of its own per round (a
restarted group never reads a failed round's keys, pytorch/pytorch#135712). The workers' own store is not this
one: as with torch's handlers, the workers' rank 0 hosts it on a free port (``MASTER_PORT``).

It has the methods of torch's documented ``RendezvousHandler`` interface (torch calls them; it checks no base
class), and is registered under ``ddpkit-loopback`` by
:func:`ddpkit.launch.torchrun_adapter.register_loopback_rendezvous`, which hands it ``info``: how a round's store
becomes torch's ``RendezvousInfo`` (that module is the one that reads torch's launcher).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.distributed import PrefixStore, Store

__all__ = ["OneNodeRendezvous"]


class OneNodeRendezvous:
    """Rendezvous of one agent: every round completes at once, as rank 0 of a world of one node.

    ``info(store, local_addr)``: the round's ``RendezvousInfo`` (rank 0 of 1 on ``store``, the workers' store
    on a free port of ``local_addr``)."""

    def __init__(
        self,
        store: Store,
        *,
        run_id: str,
        backend: str,
        info: Callable[[Store, str], Any],
        local_addr: str = "127.0.0.1",
    ):
        self._store = store
        self._run_id = run_id
        self._backend = backend
        self._addr = local_addr
        self._info = info
        self._round = 0
        self._closed = False

    def get_backend(self) -> str:
        return self._backend

    @property
    def use_agent_store(self) -> bool:
        # The workers' rank 0 hosts their store, as with torch's c10d handler and its store unshared
        return False

    def next_rendezvous(self) -> Any:
        """A new round: rank 0 of 1 on a fresh key space; ``MASTER_PORT`` a free port on ``local_addr``."""
        self._round += 1
        return self._info(PrefixStore(f"ddpkit-round-{self._round}/", self._store), self._addr)

    def is_closed(self) -> bool:
        return self._closed

    def set_closed(self) -> None:
        self._closed = True

    def num_nodes_waiting(self) -> int:
        # No other node can join a one-node job: the agent's monitor asks this on every tick
        return 0

    def get_run_id(self) -> str:
        return self._run_id

    def shutdown(self) -> bool:
        self._closed = True
        return True
