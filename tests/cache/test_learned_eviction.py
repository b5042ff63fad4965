"""Learned eviction: the rule by hand, the predictive marker's phases, bulk replay against the
per-call API, and its behaviour with perfect and with useless forecasts."""

import numpy as np
import pytest

from cache import ExpertCache, Replay, make_policy, simulate
from experiments.bench_simulator import synthetic_trace

A, B, C, D = (0, 0), (0, 1), (0, 2), (0, 3)


def chances(**by_expert: float) -> np.ndarray:
    """[1, 4] chances for experts a..d of layer 0."""
    row = np.zeros((1, 4))
    for name, value in by_expert.items():
        row[0, "abcd".index(name)] = value
    return row


def test_evicts_the_expert_predicted_least_likely():
    cache = ExpertCache(2, make_policy("learned-belady"))
    cache.access_many([A])
    cache.access_many([B])
    cache.on_forecast(chances(a=0.9, b=0.1))
    cache.access(C)  # B is predicted less likely than A, though A was used before it
    assert cache.resident() == {A, C}


def test_a_run_layer_keeps_only_its_chance_of_later_use():
    cache = ExpertCache(2, make_policy("learned-belady"))
    layer0, layer1, other = (0, 0), (1, 0), (1, 1)
    soon = np.array([[0.9, 0.0], [0.5, 0.0]])  # counted from this token: (0, 0) is about to run
    cache.on_forecast(soon)
    cache.access(layer0)
    cache.access(layer1)
    cache.on_forecast(np.array([[0.1, 0.0], [0.0, 0.0]]), layer=0)  # the token has run layer 0
    assert cache.state.outside[cache.key_ids([layer1])[0]] == 0.5  # layer 1's keep theirs
    cache.access(other)  # (0, 0) is now predicted less likely than (1, 0)
    assert cache.resident() == {layer1, other}


def test_unpredicted_experts_go_least_recently_used_first():
    cache = ExpertCache(2, make_policy("learned-belady"))
    for key in (A, B, A):
        cache.access(key)
    cache.access(C)  # no forecasts: B is the least recently used
    assert cache.resident() == {A, C}


def test_marker_spares_the_experts_of_the_phase_until_all_are_used():
    cache = ExpertCache(2, make_policy("learned"))
    cache.on_forecast(chances(a=0.9, b=0.0, c=0.0))
    cache.access(A)
    cache.access(B)
    # both are marked: a new phase starts and B, predicted less likely, goes
    cache.access(C)
    assert cache.resident() == {A, C}
    # A is unmarked since the new phase began and C is marked: A goes though it is predicted likelier
    cache.access(D)
    assert cache.resident() == {C, D}


def test_without_marks_the_forecast_alone_decides():
    cache = ExpertCache(2, make_policy("learned-belady"))
    cache.on_forecast(chances(a=0.9, b=0.0, c=0.0))
    cache.access(A)
    cache.access(B)
    cache.access(C)
    cache.access(D)  # A stays: predicted likeliest; C (0.0, used later than B's eviction) goes
    assert cache.resident() == {A, D}


@pytest.fixture(scope="module")
def trace():
    return synthetic_trace(n_tokens=800, n_layers=4, n_experts=16, top_k=2, top_t=4, seq_len=200, repeat=0.5, seed=5)


def oracle_chances(topk_ids: np.ndarray, n_experts: int, horizon: int = 6, first: int = 0) -> np.ndarray:
    """[N, L, E]: 1 for an expert used within tokens `first`..`horizon` from now, decaying with
    distance (`first` = 1: the chances of use by later tokens)."""
    n, n_layers, _ = topk_ids.shape
    out = np.zeros((n, n_layers, n_experts))
    for h in range(horizon, first - 1, -1):
        used = np.zeros((n, n_layers, n_experts))
        rows = np.arange(n - h)
        for layer in range(n_layers):
            used[rows[:, None], layer, topk_ids[h:, layer]] = 1.0
        out = np.where(used > 0, 0.8**h, out)
    return out


def misses(trace, policy, forecast=None, capacity=24, later=None):
    replay = Replay.build(trace["topk_ids"], trace["seq_id"], forecast_chances=forecast, later_chances=later,
                          n_experts=16)
    kwargs = {"future": replay.future()} if policy == "belady" else {}
    return simulate(replay, capacity, make_policy(policy, **kwargs)).misses


def test_perfect_forecasts_close_most_of_the_gap_to_belady(trace):
    lru, belady = misses(trace, "lru"), misses(trace, "belady")
    learned = misses(trace, "learned-belady", oracle_chances(trace["topk_ids"], 16))
    assert belady < lru and learned < belady + 0.5 * (lru - belady)


def test_chances_of_later_use_for_run_layers_save_misses(trace):
    topk = trace["topk_ids"]
    for capacity in (8, 12, 16):  # a small cache: a run layer's experts compete with the layers still to run
        without = misses(trace, "learned-belady", oracle_chances(topk, 16), capacity)
        with_later = misses(trace, "learned-belady", oracle_chances(topk, 16), capacity,
                            later=oracle_chances(topk, 16, first=1))
        assert with_later < without


def test_useless_forecasts_stay_close_to_lru(trace):
    lru = misses(trace, "lru")
    noise = np.random.default_rng(0).random((len(trace["topk_ids"]), 4, 16))
    assert misses(trace, "learned", noise) <= 1.1 * lru


@pytest.mark.parametrize("policy", ["learned", "learned-belady"])
@pytest.mark.parametrize("with_later", [False, True])
def test_bulk_replay_equals_the_per_call_api(trace, policy, with_later):
    forecast = oracle_chances(trace["topk_ids"], 16)
    later = oracle_chances(trace["topk_ids"], 16, first=1) if with_later else None
    replay = Replay.build(trace["topk_ids"], trace["seq_id"], forecast_chances=forecast, later_chances=later,
                          n_experts=16)
    bulk = simulate(replay, 24, make_policy(policy))
    cache = ExpertCache(24, make_policy(policy), n_layers=4, n_experts=16)
    steps, _, _ = replay.as_lists()
    for t, layers in enumerate(steps):
        cache.on_forecast(forecast[t])
        for layer, keys in enumerate(layers):
            cache.access_many(keys)
            if with_later:
                cache.on_forecast(later[t], layer=layer)
    assert cache.stats.misses == bulk.misses


def test_learned_eviction_needs_forecasts(trace):
    replay = Replay.build(trace["topk_ids"], trace["seq_id"], n_experts=16)
    with pytest.raises(ValueError, match="forecast_chances"):
        simulate(replay, 24, make_policy("learned"))
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        Replay.build(trace["topk_ids"], trace["seq_id"], forecast_chances=np.full((800, 4, 16), 2.0), n_experts=16)
    with pytest.raises(ValueError, match="later_chances"):
        Replay.build(trace["topk_ids"], trace["seq_id"], later_chances=np.zeros((800, 4, 16)), n_experts=16)


def test_a_prefetch_displaces_only_an_expert_predicted_less_likely():
    cache = ExpertCache(2, make_policy("learned-belady"))
    cache.on_forecast(chances(a=0.9, b=0.6, c=0.5, d=0.95))
    cache.access(A)
    cache.access(B)
    assert cache.prefetch_many([C]) == []  # C (0.5) is less likely than either resident expert
    assert cache.prefetch_many([D]) == [D]  # D (0.95) displaces B (0.6)
    assert cache.resident() == {A, D}
