"""Run a function on N real Gloo ranks on the CPU: for testing your Trainer subclasses (and ddpkit's).

Two ways, with the same arguments and the same results (each rank's return value, in rank order):

- :func:`run_on_ranks` starts fresh rank processes for one call (``ranks``);
- :class:`RankPool` keeps its ranks alive and runs one function after another, each in a fresh
  process group on a rank put back as a fresh process has it (``pool``, ``reset``); :class:`RankPools`
  holds one per world size and :func:`shared_pools` is this process's (``pools``); the ``rank_pool``
  pytest fixture hands it out (``fixtures``: ``pytest_plugins = ["ddpkit.testing.fixtures"]``).

Both raise :class:`RankFailure` with each failing rank's traceback when a rank raises, dies or hangs.

For structure alone (meshes, plans, cuts, refusals, collective counts), :func:`fake_ranks` makes this one process
any rank of any world size on torch's ``fake`` backend, in milliseconds (``fake``).
"""

from ddpkit.testing.fake import fake_ranks
from ddpkit.testing.pool import RankPool
from ddpkit.testing.pools import RankPools, shared_pools
from ddpkit.testing.ranks import RankFailure, run_on_ranks

__all__ = ["run_on_ranks", "RankFailure", "RankPool", "RankPools", "shared_pools", "fake_ranks"]
