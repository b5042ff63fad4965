"""`ExpertCache.eviction_order`: the resident keys, the policy's next victim first."""

from __future__ import annotations

from cache import ExpertCache, make_policy


def test_lru_order_is_least_recently_used_first_and_names_the_next_victim():
    cache = ExpertCache(3, make_policy("lru"), n_layers=2, n_experts=4)
    for key in [(0, 1), (1, 2), (0, 3), (0, 1)]:
        cache.access(key)
    assert cache.eviction_order() == [(1, 2), (0, 3), (0, 1)]
    cache.access((1, 0))  # evicts the first of the order
    assert cache.eviction_order() == [(0, 3), (0, 1), (1, 0)]


def test_an_lru_order_replayed_into_a_fresh_cache_gives_the_same_victims():
    """How the prediction guard seeds a probe's twin: the same keys in the same order."""
    cache = ExpertCache(4, make_policy("lru"), n_layers=1, n_experts=8)
    for expert in [5, 1, 2, 5, 7, 3, 1]:
        cache.access((0, expert))
    twin = ExpertCache(4, make_policy("learned"), n_layers=1, n_experts=8)
    for key in cache.eviction_order():
        twin.access(key)
    for expert in [0, 6, 2, 4]:
        cache.access((0, expert))
        twin.access((0, expert))
        assert cache.resident() == twin.resident()
