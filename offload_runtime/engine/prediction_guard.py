"""The prediction guard: the runtime acts on its predictor only while that moves fewer experts
than plain LRU would.

A learned policy and its prefetches pay only where the forecasts are right: where they are
wrong, learned eviction drops what LRU would have kept and the prefetches read experts nobody
uses, so the run moves more bytes than it would without a predictor (on runs/tw at 1.1 GB, 357
loads against LRU's 96 for one prompt). The guard keeps two shadows of the live cache, each the
same `ExpertCache` over the same accesses and capacity (bookkeeping only: nothing is copied): LRU,
and the live policy fed the predictor's forecasts. At each forward it adds up, as a moving sum over
about `WINDOW` forwards, how many experts more than LRU's misses the live cache loaded (demand loads
and prefetches: on one link a prefetch is a load too), and the learned shadow missed:
- acting on predictions, an excess above `SLACK` pauses them: the live cache's learned ranks are
  cleared (with no forecast, learned eviction is LRU by its tiebreak), nothing is prefetched, and
  the forecasts reach the learned shadow alone;
- paused, predictions resume once the learned shadow's excess is below -`SLACK` (it would have
  missed fewer than LRU). A policy without forecasts (predictions drive prefetches alone) has no
  learned shadow: it tries again after `PROBE_AFTER` windows.
So a wrong predictor costs one window, and a predictor that is right again is followed again, as
the robust learned-caching literature asks of a learned policy (never far below its classic twin).
"""

from __future__ import annotations

import logging

import numpy as np

from cache import ExpertCache, Key, make_policy
from cache.policy import EvictionPolicy

log = logging.getLogger(__name__)

WINDOW = 16  # forwards the comparison remembers (an exponential moving sum with this time constant)
SLACK = 4.0  # experts more than LRU's within the window before predictions count as losing (or winning)
PROBE_AFTER = 4  # windows paused before a policy without forecasts (prefetch alone) tries predictions again
WARMUP = 8  # forwards before the first judgement


class PredictionGuard:
    """LRU's and the learned policy's shadows of the live cache, and whether the runtime acts on
    predictions now (`acting`). `on_forecast` and `in` stand in for the live cache where the
    prefetcher feeds forecasts."""

    def __init__(self, cache: ExpertCache, policy: EvictionPolicy, n_layers: int, n_experts: int, top_k: int) -> None:
        self.cache = cache
        shadow = {"n_layers": n_layers, "top_k": top_k, "n_experts": n_experts}
        self.lru = ExpertCache(cache.capacity, make_policy("lru"), **shadow)
        self.learned = ExpertCache(cache.capacity, type(policy)(), **shadow) if policy.uses_forecasts else None
        self.n_layers, self.n_experts = n_layers, n_experts
        # acting from the start, then judged: starting paused until the learned shadow (eviction alone)
        # beat LRU lost the prefetches' gain: on runs/tb over 8 prompts the median ratio over no predictor
        # was 1.08 and 0.89 at 0.66 and 0.85 GB, against 1.11 and 1.11 acting first
        self.acting = True
        self.paused_forwards = 0  # forwards run without acting on predictions, in all
        self.lost_windows = 0  # times predictions were paused
        self.excess = self.learned_excess = 0.0  # loads beyond LRU's: the live cache's, the learned shadow's
        self._seen = 0
        self._last = self._counts()

    def __contains__(self, key: Key) -> bool:
        return key in self.cache

    def on_forecast(self, chances: np.ndarray, layer: int | None = None) -> None:
        """The prefetcher's forecasts: to the learned shadow, and to the live cache while acting."""
        if self.learned is not None:
            self.learned.on_forecast(chances, layer=layer)
        if self.acting:
            self.cache.on_forecast(chances, layer=layer)

    def access(self, keys: list[Key]) -> None:
        """The live cache is accessed with `keys`: so are the shadows."""
        self.lru.access_many(keys)
        if self.learned is not None:
            self.learned.access_many(keys)

    def shrink(self, capacity: int) -> None:
        """The live cache holds `capacity` keys from now on (the memory guard): so do the shadows."""
        for shadow in (self.lru, self.learned):
            if shadow is not None:
                shadow.shrink(capacity)

    def on_forward(self) -> None:
        """A forward starts: weigh the last one's loads and pause or resume predictions."""
        counts = self._counts()
        live, lru, learned = (now - then for now, then in zip(counts, self._last))
        self._last = counts
        keep = 1 - 1 / WINDOW
        self.excess = keep * self.excess + live - lru  # what acting on predictions loaded beyond LRU
        self.learned_excess = keep * self.learned_excess + learned - lru
        self._seen += 1
        if not self.acting:
            self.paused_forwards += 1
        if self._seen < WARMUP:
            return
        if self.acting and self.excess > SLACK:
            self.lost_windows += 1
            if self.lost_windows == 1:
                log.info("prediction guard: acting on the predictor loaded %.0f experts more than LRU would have over "
                         "the last %d tokens; predictions paused until they would load fewer", self.excess, WINDOW)
            self.acting = False
            self.cache.on_forecast(np.zeros((self.n_layers, self.n_experts)))  # learned ranks cleared: LRU
        elif not self.acting and (self.learned_excess < -SLACK if self.learned is not None
                                  else self.paused_forwards % (PROBE_AFTER * WINDOW) == 0):
            self.acting, self.excess = True, 0.0

    def _counts(self) -> tuple[int, int, int]:
        """(experts the live cache inserted, LRU's misses, the learned shadow's misses) so far."""
        live = self.cache.stats
        learned = self.learned.stats.misses if self.learned is not None else 0
        return live.misses + live.prefetch_inserts, self.lru.stats.misses, learned
