"""Each expert's recent use, blended into learned eviction's forecasts.

A predictor's chances of use look a few tokens ahead; past that, every expert it does not name
ranks alike, and learned eviction used to order those by recency alone. Where a decode loops over
a set of experts a little larger than the cache, recency evicts each expert just before its next
use (LRU's worst case), and right forecasts over two tokens cannot save it: on the demo model's
routing over 8 held-out prompts, learned eviction on the forecasts alone loaded up to 1.75x, 1.44x
and 1.66x LRU's experts on a prompt at 17, 33 and 35 slots, and with the history at most 1.02x,
1.04x and 1.07x (`experiments/history_sweep.py`, results/learned-history-sweep.json). The history is an exponential moving average over tokens
of whether each expert was used (1: used by every token), the frequency half of the ranking: an
expert in steady use keeps its slot even while the forecasts miss it. (It is LRFU's combined
recency and frequency, Lee et al.: a use counts less the longer ago it was.)

`UseHistory` is the runtime's (one per cache, stepped per forward); `history_chances` lays the same
average out over a trace's rows for the simulator, so both rank by the same numbers.
"""

from __future__ import annotations

import numpy as np

DECAY = 0.9  # the history's weight per token: an expert unused for 7 tokens keeps half its share
FORECAST_WEIGHT = 0.7  # the forecasts' share of the blended chance; the history has the rest
# (DECAY and FORECAST_WEIGHT: the best median of per-prompt loads over LRU's in a sweep of 0.8-0.95
# and 0.3-0.7 at 17, 33 and 35 slots, results/learned-history-sweep.json)


class UseHistory:
    """[layers, experts] moving averages of use: `step` at each forward, `used` for the experts a
    layer ran, `blend` to mix them into forecast chances (`weight` of the forecasts: 1.0 for a
    predictor whose forecasts are certain, the oracle's)."""

    def __init__(self, n_layers: int, n_experts: int, decay: float = DECAY, weight: float = FORECAST_WEIGHT) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"the history's decay must lie in (0, 1), got {decay}")
        self.decay, self.weight = decay, weight
        self.average = np.zeros((n_layers, n_experts))

    def step(self) -> None:
        """A new forward: the past counts `decay` times less."""
        self.average *= self.decay

    def used(self, layer: int, experts: list[int] | np.ndarray) -> None:
        """`layer` ran `experts` in this forward."""
        self.average[layer, experts] += 1.0 - self.decay

    def blend(self, chances: np.ndarray, layer: int | None = None) -> np.ndarray:
        """Forecast `chances` ([layers, experts] in [0, 1]) mixed with the history; with `layer`,
        `chances` is that layer's row ([experts]) and the mixed row is returned (the runtime
        mixes one layer at each layer it runs: a whole table's copy there cost O(layers²) a forward)."""
        return blend(chances, self.average if layer is None else self.average[layer], self.weight)


def blend(chances: np.ndarray, average: np.ndarray, weight: float = FORECAST_WEIGHT) -> np.ndarray:
    """`weight` of `chances` and the rest of the use `average` (same shape), in [0, 1]."""
    return weight * np.asarray(chances, dtype=np.float64) + (1.0 - weight) * np.minimum(average, 1.0)


def history_chances(topk_ids: np.ndarray, seq_id: np.ndarray, n_experts: int, decay: float = DECAY) -> np.ndarray:
    """[N, L, E] for a trace's rows (`topk_ids` [N, L, k], a sequence's rows contiguous): each
    row's use averages as `UseHistory` holds them when that row's forward starts (the sequence's
    earlier rows only; a new sequence starts from none)."""
    n, n_layers, _ = topk_ids.shape
    out = np.zeros((n, n_layers, n_experts))
    history, previous = UseHistory(n_layers, n_experts, decay), None
    for row in range(n):
        if seq_id[row] != previous:
            history.average[:] = 0.0
            previous = seq_id[row]
        history.step()
        out[row] = history.average
        for layer in range(n_layers):
            history.used(layer, topk_ids[row, layer])
    return out
