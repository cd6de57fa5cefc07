"""One :class:`RankPool` per world size, replaced after a failure: what a test session shares.

    from ddpkit.testing import shared_pools

    results = shared_pools().run(train_one, 3, args=(tmp_path,), timeout=60)

:meth:`RankPools.run` takes :func:`run_on_ranks`'s arguments, so a test moves to the pool by changing the
callee alone. The first call for a world size starts its pool; a call that fails closes that pool and
the next call for the same size starts a fresh one, so one broken test costs the next one a start-up,
not a failure. :func:`shared_pools` is this process's registry, closed when the process exits.
"""

from __future__ import annotations

import atexit
from collections.abc import Callable
from typing import Any

from ddpkit.testing.pool import RankPool


class RankPools:
    """Pools of live ranks by world size, each started on first use and after a failure."""

    def __init__(self) -> None:
        self._pools: dict[int, RankPool] = {}

    def pool(self, world_size: int) -> RankPool:
        """The live pool of ``world_size`` ranks, started now if there is none (or the last one failed)."""
        pool = self._pools.get(world_size)
        if pool is None or not pool.alive:
            if pool is not None:
                pool.close(kill=True)
            pool = self._pools[world_size] = RankPool(world_size)
        return pool

    def run(
        self,
        fn: Callable[..., Any],
        world_size: int = 2,
        *,
        args: tuple[Any, ...] = (),
        timeout: float = 120.0,
        env: dict[str, str] | None = None,
    ) -> list[Any]:
        """:func:`run_on_ranks`'s call, run by the pool of ``world_size`` ranks; results in rank order."""
        return self.pool(world_size).run(fn, args=args, timeout=timeout, env=env)

    def close(self) -> None:
        """Stop every pool's ranks; the registry stays usable (the next call starts a pool again)."""
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


_shared: RankPools | None = None


def shared_pools() -> RankPools:
    """This process's :class:`RankPools`, made on first use and closed at exit."""
    global _shared
    if _shared is None:
        _shared = RankPools()
        atexit.register(_shared.close)
    return _shared
