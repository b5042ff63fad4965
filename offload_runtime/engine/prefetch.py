"""Prefetch: which experts the runtime loads ahead of need, from the hash-building thread's tables.

Per forward of a stack, `Prefetcher.take` turns its hash table, once ready, into keys per layer:
the predicted experts of each layer (`prefetch_per_layer` per token of the forward, those scored
above zero), and with `next_token_min_chance` (cross-token prefetch) the experts the next
forward is forecast to use at least that likely (up to the model's top-k per layer, whether or not
in-token prefetch is on). While layer l runs, `keys_after(l)` gives what
to prefetch now: the stack's layers after l, nearest first, then the next forward's layers up to
l; with a `link_timing` only those whose copy can end before their layer runs (`_hideable`, the
rule `cache.timing.hideable`). The runtime requests them in one `prefetch` call, which never
evicts a key of its own, so a prefetch never evicts another wanted one. With learned eviction
the table's chances of use, blended with each expert's history of use (`cache.history`: the
runtime reports what each layer ran, `used`), reach the cache (`ExpertCache.on_forecast`). A
layer's chances renewed as it runs reach the cache only when they can decide something
(`send_forecasts`: before a miss or a prefetch inserts, before the layer is accessed again, at the
next forward): on a forward without a miss that is one call instead of one per layer (each call
runs with the CPU's caches cold from the experts' weights).
Touched only by the inference thread.
"""

from __future__ import annotations

import numpy as np
import torch

from cache import ExpertCache, Key
from cache.history import FORECAST_WEIGHT, UseHistory
from cache.timing import copies_in_time, hideable
from offload_runtime.engine.hash_builder import HashTable
from offload_runtime.engine.options import RuntimeOptions
from offload_runtime.engine.transfer import TransferEngine

STEP_PRIORITY = 2.0**24  # a newer forward's prefetches go before an older one's


class Prefetcher:
    """The prefetch plan of one runtime for the forward that runs (see the module doc)."""

    def __init__(self, cache: ExpertCache, engine: TransferEngine, n_layers: int, n_experts: int, per_layer: int,
                 options: RuntimeOptions, top_k: int, forecast_weight: float = FORECAST_WEIGHT) -> None:
        self.cache, self.engine, self.n_experts, self.per_layer = cache, engine, n_experts, per_layer
        self.top_k = top_k  # the most experts per layer a cross-token prefetch asks for: one token's
        self.options = options  # link_timing: _hideable; next_token_min_chance: _next_keys
        self.late_tables = 0  # forwards whose table was not ready when their first MoE layer ran
        self.tables_on_time = 0
        # per MoE layer after a forward's first (the first is served by no table of its own forward):
        # whether the forward's table was taken while an earlier layer ran, so its prefetches for
        # this layer could start before it; a table taken while layer l runs is late for l alone
        self.layers_on_time = 0
        self.layers_late = 0
        self.history = UseHistory(n_layers, n_experts, weight=forecast_weight)
        self.start(-1, range(n_layers))

    def start(self, step: int, layers: range) -> None:
        """A new forward `step` over the stack's MoE `layers`: nothing predicted yet."""
        self.step, self.layers = step, layers
        self.history.step()
        self.wanted: list[list[Key]] | None = None  # this forward's predicted keys, per layer
        self.wanted_next: list[list[Key]] = []  # the next forward's forecast keys, per layer (cross-token)
        self.later: np.ndarray | None = None  # this forward's chances of use by later ones (learned eviction)
        self._later_blended: np.ndarray | None = None  # `later` blended with the history (what the cache ranks by)
        self.unsent: list[int] = []  # layers whose renewed rows of `_later_blended` the cache has not had yet
        self._counted = False  # whether this forward's table was counted late or on time
        self._counted_layer = layers.start  # the last layer counted in layers_on_time / layers_late
        self._taken_at: int | None = None  # the layer running when the table was taken
        self._after = -1  # last layer whose prefetches were issued this forward
        self._rank = 0  # prefetches requested this forward

    def take(self, table: HashTable, layer: int) -> None:
        """The forward's hash table, ready while `layer` runs."""
        self.send_forecasts()
        self._taken_at = layer
        self.wanted = self._predicted_keys(table)
        if table.next_chances is not None:
            self.wanted_next = self._next_keys(table.next_chances)
        if table.chances is not None:  # learned eviction: keep what is predicted soonest
            self.later = table.later_chances.numpy()
            chances = table.chances.numpy().copy()
            ran = [earlier for earlier in self.layers if earlier < layer]  # a late table: run already
            chances[ran] = self.later[ran]
            self.cache.on_forecast(self.history.blend(chances))
            self._later_blended = self.history.blend(self.later)  # each layer's row renewed as it runs

    def keys_after(self, layer: int, demand_loads: int = 0) -> list[Key] | None:
        """While `layer` runs (its `demand_loads` requested): the keys to prefetch now, nearest
        first; None when nothing is predicted yet or `layer` was served already."""
        if self.later is not None:  # this forward has run the layer: only later ones may use its experts
            self._later_blended[layer] = self.history.blend(self.later[layer], layer)
            if layer not in self.unsent:
                self.unsent.append(layer)
        if not self._counted:
            self._counted = True
            if self.wanted is None:
                self.late_tables += 1
            else:
                self.tables_on_time += 1
        if layer > self._counted_layer:  # once per layer (a layer of many experts runs in parts)
            self._counted_layer = layer
            if self._taken_at is not None and self._taken_at < layer:
                self.layers_on_time += 1
            else:
                self.layers_late += 1
        if self.wanted is None or layer <= self._after:
            return None
        self._after = layer
        # the stack's layers after this one, then (cross-token) the next forward's up to this one
        ahead = [self.wanted[later] for later in self.layers if later > layer]
        if self.wanted_next:
            ahead += [self.wanted_next[later] for later in self.layers if later <= layer]
        if self.options.link_timing is None:
            return [key for keys in ahead for key in keys]
        return self._hideable(ahead, demand_loads)

    def send_forecasts(self) -> None:
        """The renewed rows not sent yet reach the cache (see the module doc): call it before the
        cache may insert or evict, before a layer in `unsent` is accessed again, and once a forward."""
        if self.unsent:
            self.cache.on_forecast(self._later_blended, layer=self.unsent)
            self.unsent = []

    def used(self, layer: int, experts: list[int]) -> None:
        """`layer` ran `experts` in this forward (the history learned eviction blends in)."""
        self.history.used(layer, experts)

    @property
    def priority(self) -> float:
        """The priority of the next prefetch call: after the earlier ones of this forward."""
        return self.step * STEP_PRIORITY - self._rank - 1

    def issued(self, inserted: list[Key]) -> None:
        self._rank += len(inserted)

    def _hideable(self, ahead: list[list[Key]], demand_loads: int) -> list[Key]:
        """Of `ahead` (the predicted keys of the layer-steps after the running one, nearest
        first), those whose copies can end before their layer starts (cost-aware prefetch's link
        half, the rule `cache.timing.hideable` that the simulator's `hide_only` follows too): the
        i-th layer-step on leaves i layer computes, counted from when the running layer's own
        `demand_loads` are in (its compute waits for them), less the other copies waiting or
        running and those chosen for nearer ones. Resident keys stay in the list."""
        timing = self.options.link_timing
        chosen = max(self.engine.pending - demand_loads, 0)
        kept = []
        for steps, keys in enumerate(ahead, start=1):
            room = copies_in_time(steps * timing.layer_compute_s, timing.transfer_s, chosen)
            positions, left = hideable(np.array([key in self.cache for key in keys], dtype=np.bool_), room)
            kept += [keys[i] for i in positions]
            chosen += max(room, 0) - max(left, 0)
        return kept

    def _predicted_keys(self, table: HashTable) -> list[list[Key]]:
        """Per layer of the running stack (other layers: none), the experts to prefetch, best
        first: `per_layer` per token of the forward (a prompt uses many experts per layer), those
        scored above zero."""
        count = min(self.n_experts, self.per_layer * max(table.tokens, 1))
        if count == 0:  # no in-token prefetch (learned eviction on the CPU): nothing to rank
            return [[] for _ in range(len(table.scores))]
        top = torch.topk(table.scores, count, dim=-1)
        return [[(layer, int(e)) for s, e in zip(values.tolist(), experts.tolist()) if s > 0]
                if layer in self.layers else []
                for layer, (values, experts) in enumerate(zip(top.values, top.indices))]

    def _next_keys(self, chances: torch.Tensor) -> list[list[Key]]:
        """Per layer of the running stack, the experts the next forward is forecast to use with a
        chance of at least `next_token_min_chance`, likeliest first, the model's top-k at most (the
        chances are the largest over the rows), whatever `per_layer` asks of in-token prefetch."""
        top = torch.topk(chances, min(self.n_experts, self.top_k), dim=-1)
        least = self.options.next_token_min_chance
        return [[(layer, int(e)) for c, e in zip(values.tolist(), experts.tolist()) if c >= least]
                if layer in self.layers else []
                for layer, (values, experts) in enumerate(zip(top.values, top.indices))]
