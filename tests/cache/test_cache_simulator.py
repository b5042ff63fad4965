"""The trace-driven simulator: decode order, batching, counts, prefetch timing, the benchmark."""

import json

import numpy as np
import pytest

from cache import (
    CapacityError,
    ExpertCache,
    Replay,
    batch_steps,
    expert_frequencies,
    make_policy,
    simulate,
)
from cli.main import run_command
from experiments.bench_simulator import synthetic_trace


@pytest.fixture(scope="module")
def trace():
    return synthetic_trace(
        n_tokens=600, n_layers=4, n_experts=16, top_k=2, top_t=6, seq_len=50, repeat=0.5, seed=3
    )


def one_hot_predictions(topk_ids, n_experts):
    """A perfect predictor: the true experts score 1 (the first one a little more), others 0."""
    n, n_layers, k = topk_ids.shape
    pred = np.zeros((n, n_layers, n_experts), np.float32)
    for rank in range(k):
        np.put_along_axis(pred, topk_ids[..., rank : rank + 1].astype(np.int64), 1.0 + (k - rank) * 0.1, -1)
    return pred


POLICY_NAMES = ["lru", "lfu", "fifo", "mrs", "belady", "static"]


def policy_kwargs(name, replay, trace):
    return {
        "mrs": {"top_k": 2},
        "belady": {"future": replay.future()},
        "static": {"frequencies": expert_frequencies(trace["topk_ids"], 16)},
    }.get(name, {})


def test_batch_steps_group_sequences_and_drop_finished_ones():
    seq_id = np.array([7, 7, 7, 2, 2, 5, 5, 5, 5, 9])
    assert batch_steps(seq_id, 1) == [[r] for r in range(10)]
    assert batch_steps(seq_id, 2) == [[0, 3], [1, 4], [2], [5, 9], [6], [7], [8]]
    assert batch_steps(seq_id, 3) == [[0, 3, 5], [1, 4, 6], [2, 7], [8], [9]]
    with pytest.raises(ValueError, match="contiguous"):
        batch_steps(np.array([0, 0, 1, 0]), 1)


def test_batch_access_set_is_the_union_of_the_batch():
    topk = np.array([[[0, 1]], [[1, 2]], [[3, 1]]])  # 3 rows, 1 layer, k = 2
    replay = Replay.build(topk, np.array([0, 1, 1]), batch_size=2)
    assert replay.as_lists()[0] == [[[(0, 0), (0, 1), (0, 2)]], [[(0, 3), (0, 1)]]]
    assert replay.max_layer_keys == 3
    assert replay.future().tolist() == [[0, 0], [0, 1], [0, 2], [0, 3], [0, 1]]
    with pytest.raises(CapacityError, match="minimum is 3 slots"):
        simulate(replay, 2, make_policy("lru"))


def test_demand_replay_equals_accessing_keys_one_by_one_when_k_is_1(trace):
    """With k > 1 a layer's experts protect each other (access_many); with k = 1 the replay is
    exactly the cache fed key by key in decode order."""
    topk = trace["topk_ids"][..., :1]
    replay = Replay.build(topk, trace["seq_id"])
    result = simulate(replay, 6, make_policy("lru"))
    cache = ExpertCache(6, make_policy("lru"))
    hits = sum(cache.access((layer, int(e[0]))) for row in topk for layer, e in enumerate(row))
    assert result.hits == hits
    assert result.accesses == replay.n_accesses == topk.size
    assert result.hits + result.misses == result.accesses
    assert result.stalls == result.misses and result.late_prefetches == 0


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("per_layer", [False, True])
@pytest.mark.parametrize("name", POLICY_NAMES)
def test_counts_add_up_with_prefetching(trace, name, per_layer, batch_size):
    replay = Replay.build(
        trace["topk_ids"], trace["seq_id"], batch_size=batch_size,
        topt_ids=trace["topt_ids"], topt_logits=trace["topt_logits"],
        predicted_scores=trace["predicted_scores"],
    )
    capacity = 6 if per_layer else 16
    r = simulate(replay, capacity, make_policy(name, **policy_kwargs(name, replay, trace)), per_layer=per_layer,
                 layers_ahead=1, transfer_per_step=2)
    assert r.accesses == replay.n_accesses
    assert r.hits + r.misses == r.accesses
    assert r.stalls == r.misses + r.late_prefetches <= r.accesses
    assert r.prefetch_hits <= r.prefetch_inserts
    assert r.late_prefetches <= r.prefetch_hits
    assert 0.0 <= r.stall_rate <= 1.0 and r.hit_rate == r.hits / r.accesses


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("per_layer", [False, True])
@pytest.mark.parametrize("name", POLICY_NAMES)
def test_bulk_paths_equal_the_public_calls_one_layer_step_at_a_time(trace, name, per_layer, batch_size):
    """What `simulate` drives (the compiled `ExpertCache.replay`) against the runtime's calls
    (`on_step`, `access_many`, `prefetch_many`, `unpin_many`) made one layer-step at a time:
    the same counts and the same experts resident at the end."""
    router = {"topt_ids": trace["topt_ids"], "topt_logits": trace["topt_logits"], "batch_size": batch_size}
    capacity = 6 if per_layer else 16

    def new_cache(replay, **numbering):
        policy = make_policy(name, **policy_kwargs(name, replay, trace))
        return ExpertCache(capacity, policy, per_layer=per_layer, **numbering)

    demand = Replay.build(trace["topk_ids"], trace["seq_id"], **router)
    bulk, calls = new_cache(demand, n_layers=demand.n_layers, n_experts=demand.n_experts), new_cache(demand)
    uses_scores = bulk.policy.uses_scores
    bulk.replay(demand.n_layers, demand.keys, demand.offsets, demand.scores if uses_scores else None)
    steps, scores, _ = demand.as_lists()
    for step, step_scores in zip(steps, scores):
        for layer, keys in enumerate(step):
            if uses_scores:
                calls.on_step(layer, step_scores[layer])
            calls.access_many(keys)
    assert bulk.stats.evictions > 0 and bulk.stats == calls.stats
    assert bulk.resident() == calls.resident()

    replay = Replay.build(trace["topk_ids"], trace["seq_id"], predicted_scores=trace["predicted_scores"],
                          prefetch_k=3, **router)
    calls = new_cache(replay)
    steps, scores, predictions = replay.as_lists()
    for step, predicted, step_scores in zip(steps, predictions, scores):
        calls.prefetch_many(predicted[0])
        for layer, keys in enumerate(step):
            if uses_scores:
                calls.on_step(layer, step_scores[layer])
            calls.access_many(keys, pin=True)
            calls.prefetch_many(predicted[layer + 1] if layer + 1 < replay.n_layers else [])
            calls.unpin_many(keys)
    r = simulate(replay, capacity, make_policy(name, **policy_kwargs(name, replay, trace)), per_layer=per_layer,
                 layers_ahead=1)
    s = calls.stats
    assert s.wasted_prefetches > 0 and calls.pinned() == {}
    assert (r.accesses, r.hits, r.misses, r.evictions) == (s.accesses, s.hits, s.misses, s.evictions)
    assert (r.prefetch_inserts, r.prefetch_hits, r.wasted_prefetches) == (s.prefetch_inserts, s.prefetch_hits,
                                                                         s.wasted_prefetches)


def test_belady_beats_lru_on_a_replay(trace):
    replay = Replay.build(trace["topk_ids"], trace["seq_id"], batch_size=2)
    belady = simulate(replay, 10, make_policy("belady", future=replay.future()))
    lru = simulate(replay, 10, make_policy("lru"))
    assert belady.hits > lru.hits


def test_perfect_prediction_with_an_instant_link_never_stalls(trace):
    """Room for every expert: demand replay misses each once; perfect prefetching never."""
    topk = trace["topk_ids"]
    demand = simulate(Replay.build(topk, trace["seq_id"]), 64, make_policy("lru"))
    replay = Replay.build(topk, trace["seq_id"], predicted_scores=one_hot_predictions(topk, 16))
    r = simulate(replay, 64, make_policy("lru"), layers_ahead=None, transfer_per_step=None)
    assert (r.misses, r.stalls) == (0, 0)
    assert r.prefetch_hits == r.prefetch_inserts == demand.misses > 0


def test_a_link_that_moves_nothing_turns_every_cold_load_into_a_late_prefetch(trace):
    topk = trace["topk_ids"]
    pred = one_hot_predictions(topk, 16)
    demand = simulate(Replay.build(topk, trace["seq_id"]), 64, make_policy("lru"))
    r = simulate(Replay.build(topk, trace["seq_id"], predicted_scores=pred), 64, make_policy("lru"), transfer_per_step=0)
    assert r.misses == 0  # every slot was taken by a prefetch ...
    assert r.stalls == r.late_prefetches == demand.misses  # ... that never arrived in time


def test_transfer_timing_worked_by_hand():
    """L = 3, k = 2, one token, perfect prediction, layers_ahead 1, the link moves 1 expert per layer.
    Start: L0's two experts are queued. L0: both late; L1's queued, one moves. L1: one late;
    L2's queued, one moves. L2: one late. Four stalls, no misses."""
    topk = np.array([[[0, 1], [0, 1], [0, 1]]])
    replay = Replay.build(topk, np.array([0]), predicted_scores=one_hot_predictions(topk, 2))
    r = simulate(replay, 6, make_policy("fifo"), layers_ahead=1, transfer_per_step=1)
    assert (r.accesses, r.misses, r.late_prefetches, r.stalls) == (6, 0, 4, 4)
    r = simulate(replay, 6, make_policy("fifo"), layers_ahead=1, transfer_per_step=2)
    assert (r.late_prefetches, r.stalls) == (2, 2)  # only layer 0's experts are late


def test_evicted_prefetch_is_wasted_and_its_transfer_cancelled():
    """Horizon None: at the token's start L1's predicted experts are queued behind L0's; with
    capacity 2 in all they evict L0's prefetches, which then miss; nothing stalls twice."""
    topk = np.array([[[0], [1]]])  # L0 uses expert 0, L1 expert 1
    pred = np.zeros((1, 2, 4), np.float32)
    pred[0, 0, [0, 2]] = [1.0, 0.5]
    pred[0, 1, [1, 3]] = [1.0, 0.5]  # top-2 predicted per layer
    replay = Replay.build(topk, np.array([0]), predicted_scores=pred, prefetch_k=2)
    r = simulate(replay, 2, make_policy("fifo"), layers_ahead=None, transfer_per_step=1)
    # (0,0),(0,2) queued, then (1,1) evicts (0,0) and (1,3) evicts (0,2): both wasted.
    # L0: (0,0) misses and evicts (1,1) (first in): wasted, its transfer cancelled. The link
    # moves (1,3). L1: (1,1) misses and evicts (1,3) (first in): wasted.
    assert (r.misses, r.late_prefetches, r.stalls) == (2, 0, 2)
    assert (r.prefetch_inserts, r.wasted_prefetches, r.evictions) == (4, 4, 4)


def test_a_prefetch_batch_does_not_evict_itself():
    cache = ExpertCache(2, make_policy("lfu"))  # LFU ranks fresh prefetches lowest ...
    cache.access((0, 0))
    # ... so one by one, (0,2) would evict (0,1) and (0,3) would evict (0,2)
    assert cache.prefetch_many([(0, 1), (0, 2), (0, 3)]) == [(0, 1), (0, 2)]
    assert cache.resident() == {(0, 1), (0, 2)} and cache.pinned() == {}
    assert (cache.stats.prefetch_inserts, cache.stats.wasted_prefetches) == (2, 0)


def test_mrs_needs_router_scores_and_enough_of_them(trace):
    bare = Replay.build(trace["topk_ids"], trace["seq_id"])
    with pytest.raises(ValueError, match="router scores"):
        simulate(bare, 16, make_policy("mrs", top_k=2))
    cut = Replay.build(trace["topk_ids"], trace["seq_id"], topt_ids=trace["topt_ids"], topt_logits=trace["topt_logits"], score_top=2)
    with pytest.raises(ValueError, match="score_top >= 4"):
        simulate(cut, 16, make_policy("mrs", top_k=2))


@pytest.mark.parametrize("batch_size", [1, 2])
def test_score_top_gives_mrs_the_same_result(trace, batch_size):
    args = dict(topk_ids=trace["topk_ids"], seq_id=trace["seq_id"], batch_size=batch_size,
                topt_ids=trace["topt_ids"], topt_logits=trace["topt_logits"])
    full = simulate(Replay.build(**args), 16, make_policy("mrs", top_k=2))
    cut = simulate(Replay.build(**args, score_top=4), 16, make_policy("mrs", top_k=2))
    assert (full.hits, full.evictions) == (cut.hits, cut.evictions)
    assert full.hits != simulate(Replay.build(**args), 16, make_policy("lru")).hits


def test_router_scores_are_softmax_over_top_t_summed_over_the_batch():
    topk = np.array([[[0]], [[1]]])
    topt_ids = np.array([[[0, 1]], [[1, 2]]])
    topt_logits = np.array([[[np.log(3.0), 0.0]], [[0.0, 0.0]]])
    replay = Replay.build(topk, np.array([0, 1]), batch_size=2, topt_ids=topt_ids, topt_logits=topt_logits)
    assert replay.as_lists()[1][0][0] == pytest.approx({0: 0.75, 1: 0.25 + 0.5, 2: 0.5})


def test_expert_frequencies():
    topk = np.array([[[0, 1], [2, 3]], [[0, 2], [2, 1]]])
    freq = expert_frequencies(topk, 4)
    np.testing.assert_allclose(freq, [[1.0, 0.5, 0.5, 0.0], [0.0, 0.5, 1.0, 0.5]])


def test_bench_writes_accesses_per_second(tmp_path):
    out = tmp_path / "bench.json"
    run_command(["bench-simulator", str(out), "--tokens", "300", "--layers", "2", "--experts", "8"])
    report = json.loads(out.read_text())
    for name in ("lru", "mrs"):
        assert report["policies"][name]["accesses_per_s"] > 0
        assert report["policies"][name]["accesses"] == 300 * 2 * 2
