"""Each policy against access sequences worked out by hand, MRS against its formula, the registry."""

import numpy as np
import pytest

from cache import (
    FIFO,
    LFU,
    LRU,
    MRS,
    POLICIES,
    Belady,
    ExpertCache,
    PolicyError,
    StaticHot,
    UnknownPolicyError,
    make_policy,
)

A, B, C, D = (0, 0), (0, 1), (0, 2), (0, 3)


def run(policy, sequence, capacity=2, per_layer=False):
    """'H'/'M' per access, through one-at-a-time `access` calls."""
    cache = ExpertCache(capacity, policy, per_layer=per_layer)
    return "".join("H" if cache.access(key) else "M" for key in sequence), cache


def test_lru_evicts_least_recently_used():
    hits, cache = run(LRU(), [A, B, A, C, B, A])
    # A B | A touches A | C evicts B | B evicts A | A evicts C
    assert hits == "MMHMMM"
    assert cache.resident() == {B, A}


def test_fifo_ignores_uses():
    hits, cache = run(FIFO(), [A, B, A, C, B, A])
    # A B | A hit, no reorder | C evicts A (first in) | B hit | A evicts B
    assert hits == "MMHMHM"
    assert cache.resident() == {C, A}


def test_lfu_evicts_least_used_and_forgets_on_eviction():
    hits, _ = run(LFU(), [A, A, B, C, B, C, A])
    # A:2 stays; B and C (1 use each, counts reset when evicted) keep evicting each other
    assert hits == "MHMMMMH"
    lru_hits, _ = run(LRU(), [A, A, B, C, B, C, A])
    assert lru_hits == "MHMMHHM"


def test_lfu_ties_go_to_least_recently_used():
    hits, cache = run(LFU(), [A, B, B, A, C, B, A])
    # A:2 B:2, A used last -> C evicts B; B evicts C (1 use); A hit
    assert hits == "MMHHMMH"
    assert cache.resident() == {A, B}


def test_belady_evicts_farthest_next_use():
    seq = [A, B, C, A, B, D, A, C]
    hits, _ = run(Belady(seq), seq)
    # C evicts B (A@3 < B@4) | B evicts C (A@6 < C@7) | D evicts B (never again) | C: A, D never again
    assert hits == "MMMHMMHM"
    assert run(LRU(), seq)[0] == "MMMMMMMM"


def test_belady_rejects_accesses_off_its_sequence():
    cache = ExpertCache(2, Belady([A, B]))
    cache.access(A)
    with pytest.raises(PolicyError, match="Belady"):
        cache.access(C)


def test_belady_ranks_prefetched_keys_by_their_next_use():
    seq = [A, B, A, C]
    cache = ExpertCache(2, Belady(seq))
    cache.access(A)
    cache.prefetch(C)  # next use at 3
    cache.access(B)  # evicts C (next use 3) rather than A (next use 2)
    assert cache.resident() == {A, B}


def test_static_hot_keeps_the_most_frequent():
    policy = StaticHot({A: 5, B: 1, C: 3, D: 2})
    hits, cache = run(policy, [A, B, C, B, A, D, A])
    # C evicts B(1) | B evicts C(3 < A's 5) | A hit | D evicts B | A hit
    assert hits == "MMMMHMH"
    assert cache.resident() == {A, D}


def test_static_hot_accepts_a_layer_by_expert_table():
    policy = StaticHot([[5, 1, 3, 2]])
    assert run(policy, [A, B, C, B, A, D, A])[0] == "MMMMHMH"


def test_mrs_hand_worked():
    """p = 2, alpha = 0.5. S after each step is written out; TopP must drop the third score."""
    cache = ExpertCache(2, MRS(alpha=0.5, p=2))
    cache.on_step(0, {0: 0.6, 1: 0.3, 2: 0.1})  # S = [.3, .15, 0]
    assert [cache.access(B), cache.access(A)] == [False, False]  # LRU order now: B, A
    cache.on_step(0, {2: 0.7, 1: 0.2, 0: 0.1})  # TopP drops 0: S = [.15, .175, .35]
    assert cache.access(C) is False
    assert cache.resident() == {B, C}  # A had the lowest S (LRU would have evicted B)
    cache.on_step(0, {0: 0.9, 3: 0.1})  # S = [.525, .0875, .175, .05]
    assert cache.access(A) is False
    assert cache.resident() == {A, C}  # B had the lowest S
    cache.on_step(0, [0.5, 0.5, 0.0, 0.0])  # dense vector; S = [.5125, .29375, .0875, .025]
    assert [cache.access(A), cache.access(B)] == [True, False]
    assert cache.resident() == {A, B}
    assert cache.policy.score(A) == pytest.approx(0.5125)
    assert cache.policy.score(D) == pytest.approx(0.025)


@pytest.mark.parametrize("alpha", [0.5, 0.9])
def test_mrs_matches_the_formula(alpha):
    """Random router scores over many steps (alpha 0.9 runs through the rescaling) against numpy,
    and each eviction is the resident, unpinned key of lowest S over both layers."""
    rng = np.random.default_rng(0)
    n_layers, n_experts, p, capacity = 2, 8, 3, 5
    policy = MRS(alpha=alpha, p=p)
    cache = ExpertCache(capacity, policy)
    S = np.zeros((n_layers, n_experts))
    for step in range(800):  # alpha 0.9: (0.1)^400 underflows unless the scale is folded back
        layer = step % n_layers
        s = rng.dirichlet(np.ones(n_experts))
        top = np.zeros(n_experts)
        keep = np.argsort(-s)[:p]
        top[keep] = s[keep]
        S[layer] = alpha * top + (1 - alpha) * S[layer]
        cache.on_step(layer, {int(e): float(v) for e, v in enumerate(s)})
        got = np.array([[policy.score((l, e)) for e in range(n_experts)] for l in range(n_layers)])
        np.testing.assert_allclose(got, S, rtol=1e-9, atol=1e-300)

        key = (layer, int(rng.integers(n_experts)))
        before = cache.resident()
        if key not in before and len(before) == capacity:
            expected = min(before, key=lambda k: (S[k], k))
            cache.access(key)
            assert before - cache.resident() == {expected}
        else:
            cache.access(key)


def test_mrs_needs_p_or_top_k_and_a_valid_alpha():
    assert MRS(top_k=2).p == 4
    with pytest.raises(ValueError, match="top_k"):
        MRS()
    with pytest.raises(ValueError, match="alpha"):
        MRS(alpha=1.0, top_k=2)


def test_per_layer_partitions_do_not_evict_each_other():
    for name, kwargs in [("lru", {}), ("lfu", {}), ("fifo", {}), ("mrs", {"top_k": 1}), ("static", {"frequencies": {}})]:
        cache = ExpertCache(1, make_policy(name, **kwargs), per_layer=True)
        assert [cache.access(k) for k in [(0, 0), (1, 0), (0, 0), (1, 0), (0, 1), (1, 0)]] == [
            False, False, True, True, False, True,
        ], name
        assert cache.resident() == {(0, 1), (1, 0)}


def test_registry_names_and_unknown_name():
    assert set(POLICIES) == {"lru", "lfu", "fifo", "mrs", "belady", "static", "learned", "learned-belady"}
    assert isinstance(make_policy("LRU"), LRU)
    with pytest.raises(UnknownPolicyError) as err:
        make_policy("arc")
    assert isinstance(err.value, ValueError)
    for name in POLICIES:
        assert name in str(err.value)


def test_a_policy_serves_one_cache():
    policy = LRU()
    ExpertCache(2, policy)
    with pytest.raises(PolicyError, match="one policy object per cache"):
        ExpertCache(2, policy)


def belady_reference_hits(sequence, capacity):
    """MIN by plain scans: evict the resident key whose next use is farthest."""
    def next_use(key, i):
        return next((j for j in range(i + 1, len(sequence)) if sequence[j] == key), len(sequence))

    resident, hits = set(), 0
    for i, key in enumerate(sequence):
        if key in resident:
            hits += 1
            continue
        if len(resident) == capacity:
            resident.remove(max(resident, key=lambda k: next_use(k, i)))
        resident.add(key)
    return hits


def lfu_reference_hits(sequence, capacity):
    """LFU by plain scans: fewest uses since insertion, then least recently used."""
    uses, last, hits = {}, {}, 0
    for i, key in enumerate(sequence):
        if key in uses:
            hits += 1
        else:
            if len(uses) == capacity:
                victim = min(uses, key=lambda k: (uses[k], last[k]))
                del uses[victim]
            uses[key] = 0
        uses[key] += 1
        last[key] = i
    return hits


def test_belady_and_lfu_match_plain_scans_on_a_long_sequence():
    """Thousands of accesses: the lazy heaps are compacted many times along the way."""
    rng = np.random.default_rng(1)
    sequence = [(int(l), int(e)) for l, e in zip(rng.integers(0, 2, 4000), rng.zipf(1.3, 4000) % 12)]
    assert run(Belady(sequence), sequence, 5)[0].count("H") == belady_reference_hits(sequence, 5)
    assert run(LFU(), sequence, 5)[0].count("H") == lfu_reference_hits(sequence, 5)


def test_mrs_under_a_global_budget_skips_pinned_keys():
    cache = ExpertCache(3, MRS(p=4))
    cache.on_step(0, {0: 0.1, 1: 0.2, 2: 0.3})
    cache.on_step(1, {0: 0.9})
    for key in [(0, 0), (0, 1), (1, 0)]:
        cache.access(key)
    cache.pin((0, 0))  # lowest S: 0.05
    cache.access((0, 2))
    assert cache.resident() == {(0, 0), (0, 2), (1, 0)}  # (0,1) went, S 0.1
    cache.unpin((0, 0))
    cache.access((0, 3))
    assert cache.resident() == {(0, 2), (0, 3), (1, 0)}
