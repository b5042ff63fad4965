"""The simulator models what the runtime does: each expert computed as its copy lands (EPS-MoE,
`expert_pipeline`), and a link that keeps several copies in flight at the rate measured at that
depth. Clocks worked by hand; the per-expert model never slower than the per-layer one."""

import numpy as np
import pytest

from cache import Replay, make_policy, simulate
from cache.timing import LinkTiming, TimingError
from tests.cache.test_timing import hand_replay

# token 0 loads expert 0; token 1 uses expert 0 (resident) and experts 1 and 2 (two misses)
TWO_MISSES_ONE_RESIDENT = [[(0, 0)], [(0, 0), (0, 1), (0, 2)]]


def run(timing, pipeline, accessed=TWO_MISSES_ONE_RESIDENT, capacity=3):
    return simulate(hand_replay(1, accessed), capacity, make_policy("lru"), timing=timing,
                    expert_pipeline=pipeline).timed


@pytest.mark.parametrize(("pipeline", "end", "stall"), [
    # per layer: token 0's copy 0-1, compute to 4; token 1's copies 4-5 and 5-6, compute 6-9
    (False, 9.0, 1.0 + 2.0),
    # per expert (0.5 s each: 1.5 s of experts over 3): token 0 as before (one expert, nothing to
    # overlap), ends at 4; token 1: resident expert 0 computes 4-4.5, expert 1 lands at 5 and
    # computes 5-5.5, expert 2 lands at 6 and computes 6-6.5, then attention and router 6.5-8
    (True, 8.0, 1.0 + 1.0),
])
def test_two_misses_and_one_resident_expert_end_by_hand(pipeline, end, stall):
    t = run(LinkTiming(3.0, 100, 100, expert_compute_s=1.5), pipeline)
    assert t.simulated_seconds == pytest.approx(end) and t.stall_seconds == pytest.approx(stall)
    assert t.demand_loads == 3


@pytest.mark.parametrize(("pipeline", "end"), [
    # two reads in flight at 150 B/s together: token 1's first copy starts alone (4-5), the second
    # beside it takes 2 x 100 B / 150 B/s (4-5.33); per layer: compute 5.33-8.33
    (False, 4.0 + 4.0 / 3 + 3.0),
    # per expert: 4-4.5 resident, 5-5.5 expert 1, 5.5-6 expert 2 (landed at 5.33), 6-7.5 the rest
    (True, 7.5),
])
def test_a_link_with_two_reads_in_flight_at_its_measured_rate(pipeline, end):
    timing = LinkTiming.of_curve(3.0, 100, (100.0, 150.0), expert_compute_s=1.5)
    assert timing.copy_s == pytest.approx((1.0, 4.0 / 3)) and timing.transfer_s == pytest.approx(2.0 / 3)
    assert run(timing, pipeline).simulated_seconds == pytest.approx(end)


def test_reads_in_flight_without_a_curve_share_the_rate():
    """Four misses at once on a link of four reads in flight at 100 B/s together: each copy
    takes 4 s, all four end at 4 (one link of one read: 1, 2, 3, 4)."""
    accessed = [[(0, 0), (0, 1), (0, 2), (0, 3)]]
    deep = run(LinkTiming(1.0, 100, 100, reads_in_flight=4), False, accessed, capacity=4)
    one = run(LinkTiming(1.0, 100, 100), False, accessed, capacity=4)
    assert deep.simulated_seconds == pytest.approx(5.0) and one.simulated_seconds == pytest.approx(5.0)
    piped = run(LinkTiming(1.0, 100, 100), True, accessed, capacity=4)  # 0.25 s each as it lands: 1, 2, 3, 4
    assert piped.simulated_seconds == pytest.approx(4.25)


def test_without_misses_both_models_take_the_same_time():
    """Token 0 misses both experts (copies 0-1, 1-2): per layer it ends at 2 + 2, per expert at
    1.25 (expert 0), 2.25 (expert 1), 3.75 (the rest); tokens 1-4 hit both: 2 s each in both."""
    accessed = [[(0, 0), (0, 1)]] * 5
    timing = LinkTiming(2.0, 100, 100, expert_compute_s=0.5)
    assert run(timing, False, accessed).simulated_seconds == pytest.approx(4.0 + 4 * 2.0)
    assert run(timing, True, accessed).simulated_seconds == pytest.approx(3.75 + 4 * 2.0)


def random_replay(seed, n_tokens=60, n_layers=4, n_experts=8, top_k=2, batch=1, prefetch=False):
    rng = np.random.default_rng(seed)
    ids = np.stack([np.stack([rng.choice(n_experts, top_k, replace=False) for _ in range(n_layers)])
                    for _ in range(n_tokens)])
    seq = np.repeat(np.arange(n_tokens // 20), 20)
    scores = None
    if prefetch:  # right about half the time
        scores = rng.random((n_tokens, n_layers, n_experts))
        hit = rng.random((n_tokens, n_layers)) < 0.5
        for t, layer in zip(*np.nonzero(hit)):
            scores[t, layer, ids[t, layer]] += 1.0
    return Replay.build(ids, seq, batch, predicted_scores=scores, n_experts=n_experts)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("timing", [
    LinkTiming(1e-3, 100, 100 / 2e-3, expert_compute_s=0.6e-3),
    LinkTiming(2e-3, 100, 100 / 1e-3),
    LinkTiming.of_curve(1e-3, 100, (100 / 3e-3, 100 / 2e-3, 100 / 1.8e-3), expert_compute_s=0.8e-3),
])
def test_the_per_expert_model_is_never_slower(seed, prefetch, timing):
    for policy, batch in (("lru", 1), ("lfu", 1), ("lru", 3)):
        replay = random_replay(seed, batch=batch, prefetch=prefetch)
        piped, layered = (simulate(replay, 12, make_policy(policy), layers_ahead=1 if prefetch else None,
                                   timing=timing, expert_pipeline=p) for p in (True, False))
        assert piped.hits == layered.hits  # the same cache decisions (when a prefetch's copy starts may differ)
        assert prefetch or piped.timed.demand_loads == layered.timed.demand_loads
        assert piped.timed.simulated_seconds <= layered.timed.simulated_seconds + 1e-12
        assert piped.timed.stall_seconds <= layered.timed.stall_seconds + 1e-12
        assert piped.expert_pipeline is True and layered.to_dict()["expert_pipeline"] is False


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"reads_in_flight": 0}, "reads_in_flight must be a finite number > 0"),
    ({"reads_in_flight": 1.5}, "reads_in_flight must be a whole number"),
    ({"reads_in_flight": 2, "depth_rates": (50.0,)}, "depth_rates are the rates with 1..reads_in_flight"),
    ({"reads_in_flight": 2, "depth_rates": (50.0, 80.0)}, "the last link_bytes_per_s"),
    ({"depth_rates": (-1.0,)}, r"depth_rates\[0\] must be a finite number > 0"),
    ({"expert_compute_s": 2.0}, "expert_compute_s .* is part of layer_compute_s"),
])
def test_bad_link_depths_and_expert_times_are_refused(kwargs, match):
    with pytest.raises(TimingError, match=match):
        LinkTiming(1.0, 100, 100, **kwargs)
