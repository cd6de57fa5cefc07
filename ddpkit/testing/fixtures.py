"""pytest fixtures for the rank pool; enable them in your ``conftest.py`` with one line:

    pytest_plugins = ["ddpkit.testing.fixtures"]

    def test_two_ranks(rank_pool, tmp_path):
        results = rank_pool.run(train_one, 2, args=(tmp_path,), timeout=60)
        assert results[0] == results[1]

``rank_pool`` is per session, not per module. What makes a pooled call cost less than fresh ranks is
the imports the ranks keep (torch's FSDP and pipelining, transformers, your own modules); a pool per module
would pay them again in every module. Isolation does not need a new pool: every call already runs in a
fresh process group on a rank reset to a fresh process's state, and a failing call replaces its pool.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ddpkit.testing.pools import RankPools, shared_pools


@pytest.fixture(scope="session")
def rank_pool() -> Iterator[RankPools]:
    """The session's pools of live Gloo ranks (:class:`ddpkit.testing.RankPools`), closed at its end."""
    pools = shared_pools()
    yield pools
    pools.close()
