"""The compiled cache fuzzed from its public entry points (hypothesis): keys and ids out of range,
junk keys, broken offsets, NaN scores. Every call either works, keeping the cache's invariants,
or raises `CacheError`; the kernels never index outside their arrays (this process would crash
or the invariants break)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from cache import CacheError, ExpertCache, Replay, make_policy

FUZZ = settings(max_examples=60, deadline=None)
SERVING = ("lru", "lfu", "fifo", "mrs")

whole = st.one_of(st.integers(-3, 9), st.sampled_from([-(1 << 40), 1 << 31, 1 << 40]))
junk = st.sampled_from([1.5, "a", None, (1,), (1, 2, 3), (True, 0), (0.0, 1)])
keys = st.lists(st.one_of(st.tuples(whole, whole), junk), max_size=6)


def make_cache(policy: str, capacity: int, bounded: bool) -> ExpertCache:
    return ExpertCache(capacity, make_policy(policy, **({"p": 2} if policy == "mrs" else {})),
                       n_layers=3 if bounded else None,
                       n_experts=5 if bounded else None)


def check_invariants(cache: ExpertCache) -> None:
    assert len(cache) <= cache.capacity
    assert len(cache.resident()) == len(cache)
    assert set(cache.pinned()) <= set(cache.resident())
    stats = cache.stats
    assert stats.hits + stats.misses == stats.accesses and stats.evictions >= 0


@FUZZ
@given(policy=st.sampled_from([*SERVING, "learned"]), capacity=st.integers(1, 6), bounded=st.booleans(),
       data=st.data())
def test_per_call_entry_points_never_crash(policy, capacity, bounded, data):
    cache = make_cache(policy, capacity, bounded)
    for _ in range(data.draw(st.integers(1, 12))):
        call = data.draw(st.sampled_from(["access", "prefetch", "pin", "unpin", "on_step", "on_forecast"]))
        try:
            if call == "access":
                cache.access_many(data.draw(keys), pin=data.draw(st.booleans()))
            elif call == "prefetch":
                cache.prefetch_many(data.draw(keys))
            elif call in ("pin", "unpin"):
                getattr(cache, call)(data.draw(st.one_of(st.tuples(whole, whole), junk)))
            elif call == "on_forecast":
                shape = data.draw(st.sampled_from([(3, 5), (4, 5), (3, 7), (15,), (0, 5)]))
                cache.on_forecast(np.full(shape, data.draw(st.sampled_from([0.0, 0.7, 1.0, 1.5, np.nan]))))
            else:
                scores = data.draw(st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=6))
                cache.on_step(data.draw(whole), scores)
        except CacheError:
            pass
        check_invariants(cache)


def id_arrays(n: int) -> st.SearchStrategy[np.ndarray]:
    return st.lists(st.integers(-2, n + 2), max_size=12).map(lambda v: np.array(v, dtype=np.int64))


offsets = st.lists(st.integers(-2, 14), min_size=0, max_size=8).map(lambda v: np.array(v, dtype=np.int64))


def values_for(ids: np.ndarray, drawn: list[float]) -> np.ndarray:
    return np.array(drawn + [0.5] * (len(ids) - len(drawn)), dtype=np.float64)[:len(ids)]


@FUZZ
@given(policy=st.sampled_from([*SERVING, "learned"]), capacity=st.integers(1, 6), n_layers=st.integers(-1, 4),
       ids=id_arrays(15), steps=offsets, score_ids=id_arrays(15), score_steps=offsets,
       score_values=st.lists(st.floats(allow_nan=True), max_size=12), predicted_ids=id_arrays(15),
       predicted_steps=offsets, forecast_ids=id_arrays(15), forecast_steps=offsets,
       chances=st.lists(st.floats(-0.5, 1.5) | st.just(float("nan")), max_size=12), ahead=st.integers(-1, 5),
       which=st.sampled_from(["demand", "prefetch", "timed"]))
def test_replays_never_crash(policy, capacity, n_layers, ids, steps, score_ids, score_steps, score_values,
                             predicted_ids, predicted_steps, forecast_ids, forecast_steps, chances, ahead, which):
    cache = make_cache(policy, capacity, bounded=True)
    scores = (score_ids, values_for(score_ids, score_values), score_steps)
    predicted = (predicted_ids, predicted_steps) if which != "demand" else None
    forecasts = (forecast_ids, values_for(forecast_ids, chances), values_for(forecast_ids, chances[::-1]),
                 forecast_steps) if policy == "learned" else None
    try:
        if which == "timed":
            cache.replay_timed(n_layers, ids, steps, 1e-3, 2e-3, scores=scores, predicted=predicted, layers_ahead=ahead,
                               forecasts=forecasts)
        else:
            cache.replay(n_layers, ids, steps, scores=scores, predicted=predicted, layers_ahead=ahead, bandwidth=1,
                         forecasts=forecasts)
    except CacheError:
        pass
    check_invariants(cache)


@FUZZ
@given(topk=st.lists(st.integers(-1, 12), min_size=4, max_size=4), logit=st.sampled_from([0.0, np.nan, np.inf]),
       n_experts=st.integers(1, 10))
def test_replay_build_refuses_ids_out_of_range_and_nan(topk, logit, n_experts):
    topk_ids = np.array(topk, dtype=np.int64).reshape(2, 1, 2)  # 2 rows, 1 layer, k = 2
    logits = np.array([[[logit, 0.0]], [[0.0, 0.0]]])
    legal = all(0 <= e < n_experts for e in topk) and np.isfinite(logit)
    try:
        replay = Replay.build(topk_ids, np.zeros(2, np.int64), topt_ids=topk_ids, topt_logits=logits,
                              n_experts=n_experts)
    except CacheError:
        assert not legal
    else:
        assert legal and replay.keys.max() < n_experts
