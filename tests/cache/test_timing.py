"""The time-true simulator: hand-computed clocks (of the per-layer model where a test says
`expert_pipeline=False`; the per-expert one is in test_expert_pipeline_sim), the transfer queue's
order, bytes moved and wasted, the count-only model untouched, bad parameters refused."""

import math

import numpy as np
import pytest

from cache import Replay, make_policy, simulate
from cache.errors import ReplayInputError
from cache.timing import LinkTiming, TimingError

E = 8  # experts per layer in the hand-made replays


def hand_replay(n_layers, accessed, predicted=None):
    """A one-sequence Replay from per-layer-step lists of (layer, expert): `accessed[j]` and
    `predicted[j]` for layer-steps j = t·n_layers + l."""
    def flat(steps):
        keys = [layer * E + e for step in steps for layer, e in step]
        return np.array(keys, np.int64), np.r_[0, np.cumsum([len(s) for s in steps])].astype(np.int64)

    keys, offsets = flat(accessed)
    return Replay(n_layers, E, 1, 1, keys, offsets, predicted=flat(predicted) if predicted else None,
                  n_tokens=len(accessed) // n_layers)


def timing(compute, transfer):
    """Compute seconds per layer-step; seconds per expert over the link (100-byte experts)."""
    return LinkTiming(compute, 100, 100 / transfer)


def test_a_demand_miss_on_an_idle_link_stalls_for_its_whole_transfer():
    r = simulate(hand_replay(1, [[(0, 0)]]), 1, make_policy("lru"), timing=LinkTiming(1.0, 100, 50))
    t = r.timed
    assert t.stall_seconds == 2.0 and t.simulated_seconds == 3.0  # 100 B / 50 B/s, then 1 s compute
    assert (t.demand_loads, t.prefetch_loads, t.bytes_moved, t.bytes_wasted) == (1, 0, 100, 0)
    assert t.tokens_per_s == pytest.approx(1 / 3)
    d = r.to_dict()
    assert (d["stall_seconds_per_token"], d["bytes_moved_per_token"], d["tokens_per_s"]) == (2.0, 100, t.tokens_per_s)


def test_demand_misses_queue_behind_each_other():
    r = simulate(hand_replay(1, [[(0, 0), (0, 1), (0, 2)]]), 3, make_policy("lru"), timing=timing(1.0, 0.5),
                 expert_pipeline=False)
    assert r.timed.stall_seconds == 1.5 and r.timed.simulated_seconds == 2.5


def prefetched_layer_replay(n_tokens):
    """Two layers: layer 0 always uses expert 0, layer 1 expert 1, 2, 3, 1, ... in turn, each
    predicted exactly one layer ahead (per-layer capacity 1: each prefetch evicts the last one)."""
    accessed, predicted = [], []
    for t in range(n_tokens):
        accessed += [[(0, 0)], [(1, 1 + t % 3)]]
        predicted += [[(0, 0)], [(1, 1 + t % 3)]]
    return hand_replay(2, accessed, predicted)


def test_a_prefetch_one_layer_ahead_on_a_link_faster_than_compute_never_stalls():
    n = 20
    r = simulate(prefetched_layer_replay(n), 1, make_policy("lru"), per_layer=True, layers_ahead=1,
                 timing=timing(1.0, 0.9))
    t = r.timed
    # only the first token's layer 0 waits: its prediction is issued as the token starts
    assert t.stall_seconds == pytest.approx(0.9)
    assert t.simulated_seconds == pytest.approx(2 * n * 1.0 + 0.9)
    assert r.late_prefetches == 1 and r.misses == 0
    assert (t.demand_loads, t.prefetch_loads, t.wasted_loads) == (1, n, 0)


def test_a_prefetch_in_flight_when_its_layer_starts_stalls_for_the_rest():
    n = 20
    r = simulate(prefetched_layer_replay(n), 1, make_policy("lru"), per_layer=True, layers_ahead=1,
                 timing=timing(1.0, 1.5))
    t = r.timed
    # token 0: layer 0 waits 1.5 s; every token: layer 1's copy starts with layer 0's compute, 0.5 s late
    assert t.stall_seconds == pytest.approx(1.5 + 0.5 * n)
    assert t.simulated_seconds == pytest.approx(2 * n + 1.5 + 0.5 * n)
    assert r.late_prefetches == 1 + n and r.stalls == r.late_prefetches


def test_demand_loads_jump_ahead_of_queued_prefetches():
    """Both of layer 1's predictions queue when the token starts; layer 0's miss goes first (1 s,
    not 2 s); the second prediction, still queued when layer 1 starts, becomes a demand load."""
    replay = hand_replay(2, [[(0, 0)], [(1, 2)]], [[], [(1, 1), (1, 2)]])
    r = simulate(replay, 4, make_policy("lru"), layers_ahead=None, timing=timing(1.0, 1.0))
    t = r.timed
    assert t.stall_seconds == 2.0 and t.simulated_seconds == 4.0
    assert (t.demand_loads, t.prefetch_loads) == (2, 1)
    assert r.misses == 1 and r.late_prefetches == 1


def test_a_newer_tokens_prefetches_go_before_an_older_ones():
    """Token 0 leaves two wrong predictions queued on a slow link; token 1's prediction is copied
    before the one still queued when it is issued (first in, first out would stall 2.5 s)."""
    replay = hand_replay(2, [[(0, 0)], [(1, 0)], [(0, 0)], [(1, 3)]],
                         [[], [(1, 1), (1, 2), (1, 4)], [], [(1, 3)]])
    r = simulate(replay, 8, make_policy("lru"), layers_ahead=None, timing=timing(1.0, 1.5))
    t = r.timed
    # 0: miss (0,0) until 1.5, compute to 2.5 while (1,1) copies 1.5-3.0
    # 2.5: miss (1,0) behind it until 4.5, compute to 5.5 while (1,2) copies 4.5-6.0
    # 5.5: token 1 queues (1,3), ahead of (1,4); hit (0,0), compute to 6.5
    # 6.5: (1,3) copies 6.0-7.5: 1 s late; compute to 8.5 while (1,4) copies 7.5-9.0
    assert t.stall_seconds == pytest.approx(1.5 + 2.0 + 1.0)
    assert t.simulated_seconds == pytest.approx(8.5)
    assert (t.demand_loads, t.prefetch_loads, r.late_prefetches) == (2, 4, 1)


def test_bytes_wasted_counts_prefetches_copied_and_evicted_unused():
    """Per-layer capacity 1, both predictions wrong. Layer 0's is still queued when the miss
    evicts it: cancelled, nothing moved. Layer 1's is copying when its miss evicts it: the copy
    ends (wasted) and the demand load waits behind it."""
    replay = hand_replay(2, [[(0, 0)], [(1, 1)]], [[(0, 1)], [(1, 3)]])
    r = simulate(replay, 1, make_policy("lru"), per_layer=True, layers_ahead=None, timing=timing(1.0, 5.0))
    t = r.timed
    assert r.wasted_prefetches == 2  # the cache's count: both evicted unused
    assert (t.demand_loads, t.prefetch_loads, t.wasted_loads) == (2, 1, 1)
    assert (t.bytes_moved, t.bytes_wasted) == (300, 100)
    # (0,0) 0-5, compute 5-6; (1,3) copies 5-10, (1,1) 10-15: stall 9; compute 15-16
    assert t.stall_seconds == 14.0 and t.simulated_seconds == 16.0


def random_replay(seed=0, n_tokens=400, n_layers=4, n_experts=16, batch_size=1):
    rng = np.random.default_rng(seed)
    logits = rng.gumbel(size=(n_tokens, n_layers, n_experts)) + np.linspace(2, 0, n_experts)
    order = np.argsort(-logits, axis=-1)
    return Replay.build(order[..., :2], np.arange(n_tokens) // 50, batch_size,
                        topt_ids=order[..., :4], topt_logits=np.take_along_axis(logits, order[..., :4], -1),
                        predicted_scores=logits + rng.normal(size=logits.shape))


def policy(name, replay):
    return make_policy(name, **{"mrs": {"top_k": 2}, "belady": {"future": replay.future()}}.get(name, {}))


@pytest.mark.parametrize("name", ["lru", "mrs", "belady"])
@pytest.mark.parametrize("layers_ahead", [1, None])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_the_clock_adds_up_and_the_cache_decides_as_without_it(name, layers_ahead, batch_size):
    replay = random_replay(batch_size=batch_size)
    link = timing(1e-3, 2.5e-3)
    timed = simulate(replay, 20, policy(name, replay), layers_ahead=layers_ahead, timing=link, expert_pipeline=False)
    counted = simulate(replay, 20, policy(name, replay), layers_ahead=layers_ahead)
    decisions = ("accesses", "hits", "misses", "prefetch_inserts", "prefetch_hits", "wasted_prefetches", "evictions")
    assert [getattr(timed, k) for k in decisions] == [getattr(counted, k) for k in decisions]
    t = timed.timed
    assert t.tokens == 400
    assert t.simulated_seconds == pytest.approx(replay.n_steps * replay.n_layers * 1e-3 + t.stall_seconds)
    assert timed.misses <= t.demand_loads <= timed.misses + timed.late_prefetches
    assert t.demand_loads + t.prefetch_loads <= timed.misses + timed.prefetch_inserts
    assert t.wasted_loads <= timed.wasted_prefetches
    assert timed.stalls == timed.misses + timed.late_prefetches
    assert t.stall_seconds >= timed.misses * link.transfer_s - 1e-12  # every miss waits its whole copy


def test_demand_only_timing_charges_every_miss_a_whole_transfer_in_turn():
    replay = random_replay()
    demand = Replay(replay.n_layers, replay.n_experts, replay.top_k, 1, replay.keys, replay.offsets,
                    n_tokens=replay.n_tokens)
    r = simulate(demand, 20, make_policy("lru"), timing=timing(1e-3, 2.5e-3), expert_pipeline=False)
    assert r.timed.stall_seconds == pytest.approx(r.misses * 2.5e-3)
    assert r.timed.demand_loads == r.misses and r.timed.prefetch_loads == 0


def test_the_count_only_model_is_unchanged():
    replay = random_replay()
    r = simulate(replay, 20, make_policy("lru"), layers_ahead=1, transfer_per_step=2)
    assert r.timed is None and r.transfer_per_step == 2
    d = r.to_dict()
    assert "simulated_seconds" not in d and "tokens_per_s" not in d


@pytest.mark.parametrize("args", [(0, 1, 1), (1, -5, 1), (1, 1, 0), (None, 1, 1), (1, float("nan"), 1),
                                  (1, 1, math.inf), ("1", 1, 1), (True, 1, 1)])
def test_bad_timing_parameters_are_refused(args):
    with pytest.raises(TimingError, match="timing parameter"):
        LinkTiming(*args)


def test_timing_is_a_link_timing_and_not_both_link_models():
    replay = hand_replay(1, [[(0, 0)]])
    with pytest.raises(TimingError, match="LinkTiming"):
        simulate(replay, 1, make_policy("lru"), timing={"layer_compute_s": 1})
    with pytest.raises(ValueError, match="not both"):
        simulate(replay, 1, make_policy("lru"), transfer_per_step=1, timing=timing(1.0, 1.0))


def test_hide_only_drops_the_prefetches_that_cannot_end_before_their_layer():
    n = 20  # layer 1's copy (1.5 s) cannot hide behind layer 0's compute (1 s): none is issued
    r = simulate(prefetched_layer_replay(n), 1, make_policy("lru"), per_layer=True, layers_ahead=1,
                 timing=timing(1.0, 1.5), hide_only=True, expert_pipeline=False)
    t = r.timed
    assert (t.prefetch_loads, r.prefetch_inserts, r.late_prefetches) == (0, 0, 0)
    assert r.misses == 1 + n and t.stall_seconds == pytest.approx(1.5 * (1 + n))  # every one a demand load
    fits = simulate(prefetched_layer_replay(n), 1, make_policy("lru"), per_layer=True, layers_ahead=1,
                    timing=timing(1.0, 0.9), hide_only=True, expert_pipeline=False)  # 0.9 s fits behind 1 s: all of layer 1's go
    assert fits.timed.prefetch_loads == n and fits.misses == 1 and fits.timed.stall_seconds == pytest.approx(0.9)


@pytest.mark.parametrize("layers_ahead", [1, None])
def test_hide_only_on_a_link_slower_than_a_token_is_demand_loading(layers_ahead):
    replay = random_replay()
    demand = Replay(replay.n_layers, replay.n_experts, replay.top_k, 1, replay.keys, replay.offsets,
                    n_tokens=replay.n_tokens)
    slow = timing(1e-3, 5e-3)  # one copy outlasts the compute of a token's 4 layers
    gated = simulate(replay, 20, make_policy("lru"), layers_ahead=layers_ahead, timing=slow, hide_only=True)
    alone = simulate(demand, 20, make_policy("lru"), timing=slow)
    assert gated.timed.prefetch_loads == gated.prefetch_inserts == 0
    assert (gated.hits, gated.misses, gated.timed.simulated_seconds) == (alone.hits, alone.misses,
                                                                         alone.timed.simulated_seconds)
    fast = timing(1e-3, 1e-4)
    hidden = simulate(replay, 20, make_policy("lru"), layers_ahead=layers_ahead, timing=fast, hide_only=True)
    assert hidden.timed.prefetch_loads > 0
    with pytest.raises(TimingError, match="give timing"):
        simulate(replay, 20, make_policy("lru"), hide_only=True)


def next_token_replay(n_tokens, forecast=True):
    """Two layers: layer 0 uses expert 1, 2, 3, 1, ... in turn, layer 1 always expert 0; each
    layer-step predicts its own experts and, with `forecast`, (t, l) also forecasts (t+1, l)."""
    accessed = [step for t in range(n_tokens) for step in ([(0, 1 + t % 3)], [(1, 0)])]
    replay = hand_replay(2, accessed, accessed)
    if forecast:
        following = accessed[2:] + [[], []]
        keys = np.array([layer * E + e for step in following for layer, e in step], np.int64)
        replay.next_predicted = keys, np.r_[0, np.cumsum([len(s) for s in following])].astype(np.int64)
    return replay


def test_cross_token_prefetch_hides_the_next_tokens_first_layer_behind_this_ones_compute():
    n = 10  # a copy (1.5 s) outlasts a layer's compute (1 s) but not a token's (2 s)
    alone = simulate(next_token_replay(n, forecast=False), 2, make_policy("lru"), per_layer=True, layers_ahead=None,
                     timing=timing(1.0, 1.5), hide_only=True, expert_pipeline=False)
    assert alone.timed.prefetch_loads == 0 and alone.timed.stall_seconds == pytest.approx(1.5 * (n + 1))
    r = simulate(next_token_replay(n), 2, make_policy("lru"), per_layer=True, layers_ahead=None, timing=timing(1.0, 1.5),
                 hide_only=True, expert_pipeline=False)
    t = r.timed
    # token 0: layer 0 misses (1.5 s); its compute issues token 1's layer-0 expert (1.5-3.0 s), ahead of
    # which layer 1's miss waits (3.0-4.5 s); every later token finds both experts in
    assert t.stall_seconds == pytest.approx(1.5 + 2.0)
    assert t.simulated_seconds == pytest.approx(5.5 + 2.0 * (n - 1))
    assert (t.demand_loads, t.prefetch_loads, t.wasted_loads) == (2, n - 1, 0)
    assert r.misses == 2 and r.late_prefetches == 0


def test_cross_token_prefetch_alone_without_in_token_predictions():
    """No layer-step predicts its own experts, each forecasts the next token's: the replay still
    prefetches across tokens, as the runtime does under learned eviction on the CPU."""
    n = 10
    replay = next_token_replay(n)
    replay.predicted = np.zeros(0, np.int64), np.zeros_like(replay.predicted[1])
    t = simulate(replay, 2, make_policy("lru"), per_layer=True, layers_ahead=None, timing=timing(1.0, 1.5),
                 hide_only=True, expert_pipeline=False).timed
    assert (t.demand_loads, t.prefetch_loads, t.wasted_loads) == (2, n - 1, 0)
    topk = np.array([[[0], [1]], [[2], [3]]])
    scores = np.full((2, 2, 4), 0.5)
    built = Replay.build(topk, np.zeros(2, np.int64), predicted_scores=scores, predicted_min_score=0.6, n_experts=4)
    assert built.predicted[0].tolist() == [] and built.predicted[1].tolist() == [0, 0, 0, 0, 0]


def test_cross_token_prefetch_keeps_the_likely_experts_and_needs_timing():
    topk = np.array([[[0], [1]], [[2], [3]]])  # 2 tokens, 2 layers, top-1
    chances = np.zeros((2, 2, 4))
    chances[0, 0, 2], chances[0, 1, 3], chances[0, 1, 0] = 0.9, 0.4, 0.3
    replay = Replay.build(topk, np.zeros(2, np.int64), predicted_scores=np.zeros((2, 2, 4)), n_experts=4,
                          next_chances=chances, next_token_min_chance=0.5)
    keys, offsets = replay.next_predicted
    assert keys.tolist() == [2] and offsets.tolist() == [0, 1, 1, 1, 1]  # (0, 2) for token 1; (1, 3) below 0.5
    with pytest.raises(TimingError, match="give timing"):
        simulate(replay, 2, make_policy("lru"))
    with pytest.raises(ReplayInputError, match="give both"):
        Replay.build(topk, np.zeros(2, np.int64), n_experts=4, next_chances=chances)
