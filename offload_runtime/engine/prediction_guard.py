"""The prediction guard: the runtime acts on its predictor only while that moves fewer experts
than plain LRU would.

A learned policy and its prefetches pay only where the forecasts are right: where they are
wrong, learned eviction drops what LRU would have kept and the prefetches read experts nobody
uses, so the run moves more bytes than it would without a predictor (on runs/tw at 1.1 GB, 357
loads against LRU's 96 for one prompt). The guard keeps two shadows of the live cache, each the
same `ExpertCache` over the same accesses and capacity (bookkeeping only: nothing is copied): LRU,
and the live policy fed the predictor's forecasts. Per window of `WINDOW` forwards:
- acting on predictions, it compares the experts the live cache loaded (demand loads and
  prefetches) with LRU's misses; more than `MARGIN` times as many (plus `SLACK`) pauses predictions:
  the live cache's learned ranks are cleared (with no forecast, learned eviction is LRU by its
  tiebreak), nothing is prefetched, and the forecasts reach the learned shadow alone;
- paused, it compares the learned shadow's misses with LRU's; predictions resume once the learned
  shadow misses fewer than LRU's divided by `MARGIN` (less `SLACK`). A policy without forecasts
  (predictions drive prefetches alone) has no learned shadow: it tries again after `PROBE_AFTER`
  windows.
So a wrong predictor costs one window, and a predictor that is right again is followed again, as
the robust learned-caching literature asks of a learned policy (never far below its classic twin).
"""

from __future__ import annotations

import logging

import numpy as np

from cache import ExpertCache, Key, make_policy
from cache.policy import EvictionPolicy

log = logging.getLogger(__name__)

WINDOW = 16  # forwards per comparison
MARGIN = 1.0  # predictions must load no more than LRU (a prefetch shares the link with demand loads)
SLACK = 1  # and by this many experts per window
PROBE_AFTER = 4  # windows paused before a policy without forecasts (prefetch alone) tries predictions again


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
        self.acting = True  # the runtime prefetches and feeds the live cache forecasts
        self.paused_forwards = 0  # forwards run without acting on predictions, in all
        self.lost_windows = self.won_windows = 0
        self._left = WINDOW  # forwards left in this window
        self._start = self._counts()

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
        """A forward starts: judge a window that ended."""
        if not self.acting:
            self.paused_forwards += 1
        self._left -= 1
        if self._left > 0:
            return
        live, lru, learned = (now - then for now, then in zip(self._counts(), self._start))
        if self.acting and live > MARGIN * lru + SLACK:
            self.lost_windows += 1
            if self.lost_windows == 1:
                log.info("prediction guard: acting on the predictor loaded %d experts in %d tokens where LRU would "
                         "have loaded %d; predictions paused until they would load fewer", live, WINDOW, lru)
            self.acting = False
            self.cache.on_forecast(np.zeros((self.n_layers, self.n_experts)))  # learned ranks cleared: LRU
        elif not self.acting and (learned < lru / MARGIN - SLACK if self.learned is not None
                                  else self.paused_forwards % (PROBE_AFTER * WINDOW) == 0):
            self.acting = True
        elif self.acting:
            self.won_windows += 1
        self._left, self._start = WINDOW, self._counts()

    def _counts(self) -> tuple[int, int, int]:
        """(experts the live cache inserted, LRU's misses, the learned shadow's misses) so far."""
        live = self.cache.stats
        learned = self.learned.stats.misses if self.learned is not None else 0
        return live.misses + live.prefetch_inserts, self.lru.stats.misses, learned
