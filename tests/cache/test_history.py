"""The history of use that learned eviction blends into its forecasts (`cache.history`)."""

import numpy as np
import pytest

from cache import Replay, make_policy, simulate
from cache.history import DECAY, FORECAST_WEIGHT, UseHistory, blend, history_chances


def test_the_history_is_a_moving_average_of_use_per_forward():
    history = UseHistory(2, 4)
    for forward in range(200):  # expert 1 of layer 0 runs every forward, expert 2 every other one
        history.step()
        history.used(0, [1, 2] if forward % 2 else [1])
    assert history.average[0, 1] == pytest.approx(1.0, abs=1e-6)
    assert 0.3 < history.average[0, 2] < 0.7 and not history.average[1].any()
    history.step()
    assert history.average[0, 1] == pytest.approx(DECAY, abs=1e-6)


def test_blending_mixes_the_forecast_with_the_history_and_one_layer_alone():
    chances, average = np.full((2, 3), 0.5), np.array([[1.0, 0.0, 3.0], [1.0, 1.0, 1.0]])
    mixed = blend(chances, average)
    assert mixed[0].tolist() == pytest.approx([0.5 * FORECAST_WEIGHT + (1 - FORECAST_WEIGHT), 0.5 * FORECAST_WEIGHT,
                                               0.5 * FORECAST_WEIGHT + (1 - FORECAST_WEIGHT)])  # capped at 1
    history = UseHistory(2, 3)
    history.average[:] = average
    assert history.blend(chances[1], layer=1) == pytest.approx(mixed[1])  # one layer's row alone


def test_a_traces_history_is_what_the_runtime_holds_at_each_forward_and_restarts_per_sequence():
    topk = np.array([[[0]], [[1]], [[0]], [[1]]])  # [N, L=1, k=1]
    out = history_chances(topk, np.array([0, 0, 0, 1]), n_experts=2)
    history = UseHistory(1, 2)
    for row in range(3):
        history.step()
        assert np.allclose(out[row], history.average)
        history.used(0, topk[row, 0])
    assert not out[3].any()  # a new sequence starts with no history


def test_with_forecasts_that_say_nothing_the_history_keeps_the_experts_in_steady_use():
    """Zipf-like routing over 16 experts, 6 slots, flat forecasts: without the history learned eviction
    is LRU by its tiebreak; with it, the frequently used experts keep their slots and fewer are loaded."""
    rng = np.random.default_rng(0)
    weights = 1.0 / np.arange(1, 17) ** 1.2
    topk = rng.choice(16, size=(600, 1, 1), p=weights / weights.sum())
    seq = np.zeros(600, dtype=np.int64)
    flat = np.full((600, 1, 16), 0.5)
    used = history_chances(topk, seq, n_experts=16)

    def misses(chances: np.ndarray | None) -> int:
        replay = Replay.build(topk, seq, 1, n_experts=16, forecast_chances=chances, later_chances=chances)
        return simulate(replay, 6, make_policy("learned-belady" if chances is not None else "lru")).misses

    lru, flat_only, with_history = misses(None), misses(flat), misses(blend(flat, used))
    assert flat_only == lru  # equal chances: the tiebreak's recency
    assert with_history < 0.9 * lru
