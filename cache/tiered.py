"""TieredCache: mixed precision's residency, two caches (a fine tier and a coarse one) whose
slots differ in size, and the rule that picks the tier of each copy loaded.

A key is resident in at most one tier; an access hits if either holds it. A miss (or a prefetch)
goes where the precision rule sends it: the fine tier for the `per_layer` experts of its layer the
rule ranks highest, the coarse tier for the rest, and the other tier when the chosen one has no
room left (all its slots pinned or taken by the same call). Each tier evicts within itself by its
own instance of the serving policy. The rules, the three the field uses:

- "router" (HOBBIT): the router's probability of the expert for the running forward's tokens
  (`on_step`; for a prefetch, the last forward's at that layer): a token's highest-weighted
  experts weigh most in its output.
- "forecast" (ours): the expected weight of the expert's later uses, the predictor's chance that
  the tokens after this one use it (`on_later`, a forecaster's later-token chances) times its
  router probability: the fine copy goes to what coming tokens will reuse and weigh.
- "hotness" (DynaExq, Fate): how often the expert was used so far in this run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import fields

import numpy as np

from cache.errors import CacheError
from cache.expert_cache import CacheStats, ExpertCache
from cache.policy import EvictionPolicy, Key

PRECISION_RULES = ("forecast", "router", "hotness")
FINE, COARSE = 0, 1


class TieredCache:
    """`tiers[0]` holds fine copies, `tiers[1]` coarse ones; `rule` (see the module doc) ranks
    each layer's experts and the fine tier takes the top `per_layer` of a layer."""

    def __init__(self, tiers: Sequence[ExpertCache], rule: str, n_layers: int, n_experts: int, per_layer: int) -> None:
        if rule not in PRECISION_RULES:
            raise CacheError(f"unknown precision rule {rule!r}; use one of {', '.join(PRECISION_RULES)}")
        if len(tiers) != 2:
            raise CacheError(f"a tiered cache has a fine and a coarse tier, got {len(tiers)} tiers")
        self.tiers = list(tiers)
        self.rule = rule
        self.per_layer = max(1, per_layer)
        self.weights = np.zeros((n_layers, n_experts))  # router, forecast: the last router scores
        self.later = np.ones((n_layers, n_experts))  # forecast: chances of later use
        self.uses = np.zeros((n_layers, n_experts))  # hotness: uses so far
        self.uses_scores = rule in ("router", "forecast")  # what the runtime must hand over, as policies say
        self.uses_forecasts = rule == "forecast"

    # -- what the rule reads -----------------------------------------------------------------

    def on_later(self, later: np.ndarray) -> None:
        """The forecast rule's input: [L, E] chances that tokens after the running one use each expert."""
        if self.uses_forecasts:
            self.later[:] = later

    def on_step(self, layer: int, scores: Mapping[int, float] | Sequence[float]) -> None:
        """Router scores of a layer-step: to each tier's policy, and to the router rule."""
        for tier in self.tiers:
            tier.on_step(layer, scores)
        if self.uses_scores:
            items = scores.items() if isinstance(scores, Mapping) else enumerate(scores)
            self.weights[layer] = 0.0
            for expert, score in items:
                self.weights[layer, expert] = score

    def on_forecast(self, chances: np.ndarray, layer: int | Sequence[int] | None = None) -> None:
        for tier in self.tiers:
            tier.on_forecast(chances, layer)

    def wants_fine(self, key: Key) -> bool:
        """Whether the rule ranks `key` among the top `per_layer` of its layer (a zero score never)."""
        layer, expert = key
        row = {"router": self.weights[layer], "forecast": self.weights[layer] * self.later[layer],
               "hotness": self.uses[layer]}[self.rule]
        return row[expert] > 0 and int((row > row[expert]).sum()) < self.per_layer

    # -- the cache's interface (as the runtime and its prefetcher use `ExpertCache`) --------------

    def tier_of(self, key: Key) -> int | None:
        """The tier that holds `key`, None if neither does."""
        return next((i for i, tier in enumerate(self.tiers) if key in tier), None)

    def __contains__(self, key: Key) -> bool:
        return self.tier_of(key) is not None

    def access_many(self, keys: Sequence[Key], pin: bool = False) -> int:
        """Use `keys` (one layer-step's experts): hits in the tier that holds them, each miss
        inserted in the tier the rule picks (see the module doc); returns the number of misses."""
        for layer, expert in keys:
            self.uses[layer, expert] += 1
        placed = self._place(keys, pin)
        return sum(tier.access_many(part, pin=pin) for tier, part in zip(self.tiers, placed) if part)

    def prefetch_many(self, keys: Iterable[Key], pin: bool = False) -> list[Key]:
        """Insert the keys that neither tier holds, each in the tier the rule picks; returns
        those inserted, in the order given."""
        keys = list(keys)
        fresh = [key for key in keys if key not in self]
        inserted = set()
        for tier, part in zip(self.tiers, self._place(fresh, pin, new_only=True)):
            inserted.update(tier.prefetch_many(part, pin=pin))
        return [key for key in keys if key in inserted]

    def pin(self, key: Key) -> None:
        tier = self.tier_of(key)
        if tier is None:
            raise CacheError(f"cannot pin {key}: it is not resident; access or prefetch it first")
        self.tiers[tier].pin(key)

    def unpin_many(self, keys: Sequence[Key]) -> None:
        for tier in self.tiers:
            held = [key for key in keys if key in tier]
            if held:
                tier.unpin_many(held)

    @property
    def stats(self) -> CacheStats:
        parts = [tier.stats for tier in self.tiers]
        return CacheStats(**{f.name: sum(getattr(p, f.name) for p in parts) for f in fields(CacheStats)})

    @property
    def fine_accesses(self) -> int:
        """Accesses served by a fine copy (hit, or a miss loaded fine)."""
        return self.tiers[FINE].stats.accesses

    def _place(self, keys: Sequence[Key], pin: bool, new_only: bool = False) -> list[list[Key]]:
        """`keys` split by tier, in order: a resident key in its own; a new one where the rule
        sends it while that tier has room for one more of the call, else in the other."""
        placed: list[list[Key]] = [[], []]
        new = []
        for key in keys:
            tier = None if new_only else self.tier_of(key)
            if tier is None:
                new.append(key)
            else:
                placed[tier].append(key)
        room = [tier.capacity - len(tier.pinned()) - len(part) for tier, part in zip(self.tiers, placed)]
        for key in new:
            tier = FINE if self.wants_fine(key) else COARSE
            if room[tier] <= 0 and room[1 - tier] > 0:
                tier = 1 - tier
            placed[tier].append(key)
            room[tier] -= 1
        return placed


def tiered_cache(capacities: Sequence[int], policies: Sequence[EvictionPolicy], rule: str, n_layers: int,
                 n_experts: int, top_k: int, on_evict: Callable[[Key], None]) -> TieredCache:
    """A TieredCache of a fine tier of `capacities[0]` slots and a coarse one of `capacities[1]`
    (which must hold one layer's top-k), each with its own policy instance of `policies`; the
    fine tier takes the top `capacities[0] // n_layers` experts of each layer by `rule`."""
    fine = ExpertCache(capacities[0], policies[0], n_layers=n_layers, on_evict=on_evict)
    coarse = ExpertCache(capacities[1], policies[1], n_layers=n_layers, top_k=top_k, on_evict=on_evict)
    return TieredCache([fine, coarse], rule, n_layers, n_experts, capacities[0] // n_layers)
