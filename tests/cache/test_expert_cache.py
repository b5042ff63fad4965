"""ExpertCache: pins, prefetch statistics, capacity errors, eviction callback, threads."""

import random
import sys
import threading

import numpy as np
import pytest

from cache import (
    CacheError,
    CacheFullError,
    CapacityError,
    ExpertCache,
    make_policy,
)
from cache.policies import LFU, LRU, MRS

A, B, C, D = (0, 0), (0, 1), (0, 2), (0, 3)


def test_pinned_keys_are_never_evicted():
    cache = ExpertCache(2, LRU())
    cache.access(A)
    cache.access(B)
    cache.pin(A)  # A is least recently used, but in use
    assert cache.access(C) is False
    assert cache.resident() == {A, C}
    cache.pin(C)
    with pytest.raises(CacheFullError, match="pinned"):
        cache.access(D)
    assert cache.prefetch(D) is False
    cache.unpin(C)
    assert cache.access(D) is False
    assert cache.resident() == {A, D}


def test_pins_are_counted():
    cache = ExpertCache(1, LRU())
    cache.access(A)
    cache.pin(A)
    cache.pin(A)
    cache.unpin(A)
    with pytest.raises(CacheFullError):
        cache.access(B)
    cache.unpin(A)
    cache.access(B)
    assert cache.resident() == {B}
    with pytest.raises(CacheError, match="not pinned"):
        cache.unpin(B)
    with pytest.raises(CacheError, match="not resident"):
        cache.pin(C)


@pytest.mark.parametrize("name", ["lru", "lfu", "fifo", "static", "mrs"])
def test_access_many_never_evicts_its_own_keys(name):
    """Static-hot ranks C lowest, so one by one, B's insertion would evict the just-loaded C."""
    kwargs = {"frequencies": {A: 9, B: 1, C: 0}} if name == "static" else {"top_k": 2} if name == "mrs" else {}
    cache = ExpertCache(2, make_policy(name, **kwargs))
    cache.access(A)
    assert cache.access_many([C, B]) == 2
    assert cache.resident() == {B, C}
    assert cache.pinned() == {}


def test_access_many_pin_keeps_keys_pinned_until_released():
    cache = ExpertCache(3, LRU())
    assert cache.access_many([A, B], pin=True) == 2
    assert cache.pinned() == {A: 1, B: 1}
    cache.access(C)
    cache.access(D)  # A and B are pinned: C goes
    assert cache.resident() == {A, B, D}
    cache.unpin_many([A, B])
    assert cache.pinned() == {}


def test_access_many_that_cannot_fit_leaves_pins_as_they_were():
    cache = ExpertCache(2, LRU())
    cache.access(A)
    cache.pin(A)
    with pytest.raises(CacheFullError):
        cache.access_many([B, C])
    assert cache.pinned() == {A: 1}


def test_stats_count_prefetch_hits_and_waste():
    evicted = []
    cache = ExpertCache(2, LRU(), on_evict=evicted.append)
    assert cache.prefetch(A) is True
    assert cache.prefetch(B) is True
    assert cache.prefetch(A) is False  # already resident
    assert cache.access(A) is True  # served by a prefetch
    assert cache.access(A) is True  # A was already used once: a plain hit
    assert cache.access(C) is False  # evicts B, prefetched and never used
    s = cache.stats
    assert (s.accesses, s.hits, s.misses) == (3, 2, 1)
    assert (s.prefetch_inserts, s.prefetch_hits, s.wasted_prefetches, s.evictions) == (2, 1, 1, 1)
    assert s.hit_rate == pytest.approx(2 / 3)
    assert evicted == [B]


def test_access_many_counts_like_access():
    cache = ExpertCache(2, LFU())
    cache.prefetch(B)
    assert cache.access_many([A, B]) == 1
    assert cache.access_many([A, B]) == 0
    s = cache.stats
    assert (s.accesses, s.hits, s.misses, s.prefetch_hits) == (4, 3, 1, 1)


def test_capacity_below_top_k_names_the_minimum():
    with pytest.raises(CapacityError, match=r"minimum is 4 slots per layer"):
        ExpertCache(3, LRU(), per_layer=True, top_k=4)
    with pytest.raises(CapacityError, match=r"minimum is 2 slots in all"):
        ExpertCache(1, LRU(), top_k=2)
    ExpertCache(2, LRU(), top_k=2)


def test_n_layers_bounds_keys():
    cache = ExpertCache(4, LRU(), n_layers=2)
    cache.access((1, 3))
    with pytest.raises(CacheError, match="layer 2"):
        cache.access((2, 0))


def test_per_layer_capacity_is_per_layer():
    cache = ExpertCache(2, LRU(), per_layer=True, n_layers=3)
    for layer in range(3):
        for expert in range(4):
            cache.access((layer, expert))
    assert cache.resident() == {(l, e) for l in range(3) for e in (2, 3)}


def test_two_threads_hammering_keep_the_invariants():
    """A loader thread prefetches, an inference thread accesses and pins; the switch interval is
    cut so the threads interleave inside methods. Any race breaks the policy's bookkeeping
    (KeyError), the capacity, or the counts."""
    capacity, keys = 6, [(l, e) for l in range(3) for e in range(6)]
    cache = ExpertCache(capacity, LRU())
    errors: list[BaseException] = []
    seen_sizes: list[int] = []

    def inference(seed: int) -> None:
        rnd = random.Random(seed)
        try:
            for _ in range(20_000):
                batch = rnd.sample(keys, 2)
                cache.access_many(batch, pin=True)
                seen_sizes.append(len(cache))
                cache.unpin_many(batch)
                cache.access(rnd.choice(keys))
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    def loader(seed: int) -> None:
        rnd = random.Random(seed)
        try:
            for _ in range(40_000):
                cache.prefetch(rnd.choice(keys))
                seen_sizes.append(len(cache.resident()))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=inference, args=(1,)), threading.Thread(target=loader, args=(2,))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert errors == []
    assert max(seen_sizes) <= capacity
    s = cache.stats
    assert s.accesses == 20_000 * 3 and s.hits + s.misses == s.accesses
    assert s.prefetch_hits <= s.prefetch_inserts
    assert cache.pinned() == {}
    assert int(cache.state.heap_size.sum()) == len(cache) == len(cache.resident())  # heaps hold the residents


def test_prefetch_can_pin_the_slot_while_the_loader_fills_it():
    cache = ExpertCache(2, LRU())
    assert cache.prefetch(A, pin=True) is True
    cache.access(B)
    cache.access(C)  # A is least recently used but its slot is being filled: B goes
    assert cache.resident() == {A, C}
    cache.unpin(A)
    cache.pin(C)
    assert cache.prefetch_many([B, D], pin=True) == [B]  # B evicts A; D finds C pinned, B held
    assert cache.resident() == {B, C}
    assert cache.pinned() == {B: 1, C: 1}


def test_prefetch_many_never_evicts_a_key_of_the_same_call():
    """A is least recently used but asked for again by the call: C evicts B instead."""
    cache = ExpertCache(2, LRU())
    cache.access(A)
    cache.access(B)
    assert cache.prefetch_many([A, C]) == [C]
    assert cache.resident() == {A, C} and cache.pinned() == {}
    assert cache.prefetch_many([A, C, D]) == []  # D could only evict A or C, both asked for
    assert cache.prefetch_many([D, B], pin=True) == [D, B]  # D evicts A, B evicts C (not D)
    assert cache.resident() == {B, D} and cache.pinned() == {B: 1, D: 1}  # only the inserted


def key_steps(steps, n_experts):
    """Nested [step][layer] keys as the flat (ids, offsets) arrays `ExpertCache.replay` takes."""
    flat = [keys for step in steps for keys in step]
    ids = np.array([l * n_experts + e for keys in flat for l, e in keys], np.int64)
    return ids, np.r_[0, np.cumsum([len(keys) for keys in flat])].astype(np.int64)


def test_replay_worked_by_hand():
    """LRU, 3 slots in all. Keys a, b, c of layer 0 and x, y of layer 1.
    t0: L0 [a b] miss miss; L1 [x] miss (full; LRU order a b x).
    t1: L0 [a c] a hits; c misses and evicts b, since a (first) is used by the same call; order
        x a c. L1 [y] misses, evicts x; order a c y.
    t2: L0 [b a] b misses, evicts c (a is the call's); order y b a. L1 [x] misses, evicts y.
    Three new keys then evict the rest in LRU order: b, a, x."""
    a, b, c, x, y = (0, 0), (0, 1), (0, 2), (1, 0), (1, 1)
    steps = [[[a, b], [x]], [[a, c], [y]], [[b, a], [x]]]
    replayed = ExpertCache(3, LRU(), n_layers=3, n_experts=3)
    assert replayed.replay(2, *key_steps(steps, 3)) == 0  # no prefetching: nothing late
    evicted = []
    one_by_one = ExpertCache(3, LRU(), on_evict=evicted.append)  # the same calls, one layer-step at a time
    assert sum(one_by_one.access_many(keys) for step in steps for keys in step) == 7
    assert evicted == [b, x, c, y]
    for cache in (replayed, one_by_one):
        s = cache.stats
        assert (s.accesses, s.hits, s.misses, s.evictions) == (9, 2, 7, 4)
        assert cache.resident() == {a, b, x}
    replayed.on_evict = evicted.append
    for new in [(2, 0), (2, 1), (2, 2)]:
        replayed.access(new)
    assert evicted[4:] == [b, a, x]


def test_replay_gives_each_layer_its_router_scores_before_its_accesses():
    """MRS (alpha .5, p = 1), 2 slots in all. t0: S(0,0) = .5, S(1,0) = .1. t1 L0: S(0,0) = .25,
    S(0,1) = .5; (0,1) evicts (1,0) (.1). t1 L1: (1,1) evicts (0,0) (.25). Had layer 1's t1 scores
    (which raise S(1,0) to .55) come before layer 0's accesses, (0,1) would have evicted (0,0)."""
    steps = [[[(0, 0)], [(1, 0)]], [[(0, 1)], [(1, 1)]]]
    score_keys, score_offsets = key_steps([[[(0, 0)], [(1, 0)]], [[(0, 1)], [(1, 0)]]], 2)
    scores = (score_keys, np.array([1.0, 0.2, 1.0, 1.0]), score_offsets)
    cache = ExpertCache(2, MRS(alpha=0.5, p=1), n_layers=2, n_experts=2)
    cache.replay(2, *key_steps(steps, 2), scores=scores)
    assert cache.stats.misses == 4
    assert cache.resident() == {(0, 1), (1, 1)}
    assert cache.policy.score((0, 0)) == pytest.approx(0.25) and cache.policy.score((1, 0)) == pytest.approx(0.55)


def test_access_then_prefetch_worked_by_hand():
    """LRU, 3 slots; the runtime's layer-step: access and pin, prefetch ahead, unpin.
    a, b, c of layer 0; x, y of layer 1.
    1. [a] + [b c]: a misses; b, c prefetched; order a b c.
    2. [b] + [x y]: b hits its prefetch; order a c b. x evicts a, y evicts c (unused: wasted).
    3. [x c] + [a]: x hits its prefetch; c misses and evicts b (x is the call's); order y x c.
       a evicts y (unused: wasted), not x or c, which the layer uses.
    4. [a] + [x]: a hits its prefetch; all resident, nothing moves."""
    a, b, c, x, y = (0, 0), (0, 1), (0, 2), (1, 0), (1, 1)
    evicted = []
    cache = ExpertCache(3, LRU(), on_evict=evicted.append)
    results = []
    for keys, ahead in [([a], [b, c]), ([b], [x, y]), ([x, c], [a]), ([a], [x])]:
        misses = cache.access_many(keys, pin=True)
        results.append((misses, cache.prefetch_many(ahead)))
        cache.unpin_many(keys)
    assert results == [(1, [b, c]), (0, [x, y]), (1, [a]), (0, [])]
    assert evicted == [a, c, b, y]
    assert cache.resident() == {x, c, a} and cache.pinned() == {}
    s = cache.stats
    assert (s.accesses, s.hits, s.misses) == (5, 3, 2)
    assert (s.prefetch_inserts, s.prefetch_hits, s.wasted_prefetches, s.evictions) == (5, 3, 2, 4)


def test_a_prefetch_spares_the_pinned_keys_of_the_layer():
    """FIFO would evict A (first in), but A is being used: the prefetch of C evicts B."""
    cache = ExpertCache(2, make_policy("fifo"))
    cache.access_many([A, B])
    cache.access_many([A], pin=True)
    assert cache.prefetch_many([C]) == [C]
    cache.unpin_many([A])
    assert cache.resident() == {A, C} and cache.pinned() == {}


@pytest.mark.parametrize("per_layer", [False, True])
def test_a_cache_told_nothing_of_the_model_grows_and_decides_the_same(per_layer):
    """Without n_layers/n_experts the cache numbers keys as they come and grows its arrays (here
    past 64 keys and 1 layer); its decisions equal those of a cache numbered up front."""
    rng = random.Random(5)
    calls = [[(layer, e) for e in rng.sample(range(6), 2)] for _ in range(400) for layer in (rng.randrange(40),)]
    grown = ExpertCache(3 if per_layer else 24, make_policy("lfu"), per_layer=per_layer)
    numbered = ExpertCache(3 if per_layer else 24, make_policy("lfu"), per_layer=per_layer, n_layers=40, n_experts=6)
    for keys in calls:
        assert grown.access_many(keys) == numbered.access_many(keys)
    assert grown.stats == numbered.stats and grown.stats.evictions > 0
    assert grown.resident() == numbered.resident()
