"""OffloadRuntime: a transformers MoE model whose routed experts live in a slow tier.

Per MoE layer forward (inference thread):
  1. poll the hash-building thread's table for this forward; turn a new one into prefetches
  2. the layer's selected experts are accessed in the `ExpertCache` (pinned while in use);
     misses get a slot and a demand load, and every selected expert is waited for
  3. the model's own experts math runs on the slot weights (see `offloaded_experts`)
The cache decides residency; the slot map only mirrors it (an eviction frees the slot and
cancels a queued load). The transfer engine's workers copy store → slot.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

import torch
from torch import nn

from cache import ExpertCache, make_policy
from offload_runtime.hash_builder import HashBuilder
from offload_runtime.offloaded_experts import OffloadedExperts
from offload_runtime.slots import SlotPool
from offload_runtime.store import ExpertStore
from offload_runtime.transfer import TransferEngine
from prescient.arch import MoELayer

log = logging.getLogger(__name__)

Key = tuple[int, int]


@dataclass
class RuntimeStats:
    accesses: int
    hits: int
    misses: int
    prefetch_inserts: int
    prefetch_hits: int
    wasted_prefetches: int
    evictions: int
    prefetch_accuracy: float  # share of prefetched experts that were used before eviction
    hit_rate: float
    bytes_moved: int
    loads: int
    stall_seconds: float  # inference thread blocked on loads
    late_tables: int  # forwards whose hash table was not ready when their first MoE layer ran
    tables_on_time: int
    slots: int
    slot_bytes: int

    def to_dict(self) -> dict:
        return asdict(self)


class OffloadRuntime:
    def __init__(self, model: nn.Module, layers: list[MoELayer], store: ExpertStore, pool: SlotPool,
                 policy: str = "lru", predictor=None, prefetch_per_layer: int | None = None):
        self.model, self.layers, self.store, self.pool = model, layers, store, pool
        self.top_k = layers[0].top_k
        self.n_experts = layers[0].num_experts
        policy_args = {"top_k": self.top_k} if policy == "mrs" else {}
        self.policy = make_policy(policy, **policy_args)
        self.cache = ExpertCache(pool.num_slots, self.policy, n_layers=len(layers), top_k=self.top_k,
                                 on_evict=self._on_evict)
        self.engine = TransferEngine(store, pool)
        self.builder = HashBuilder(predictor) if predictor is not None else None
        self.prefetch_per_layer = prefetch_per_layer or self.top_k
        self._step = -1
        self._table_applied = True
        self._in_use: dict[int, list[Key]] = {}
        self.late_tables = 0
        self.tables_on_time = 0
        self._handles = [model.register_forward_pre_hook(self._on_forward, with_kwargs=True)]
        if getattr(self.policy, "uses_scores", False):
            self._handles += [layer.router.register_forward_hook(self._router_scores(layer)) for layer in layers]
        for layer in layers:  # the resident expert tensors are dropped with the old module
            layer.block.experts = layer.experts = OffloadedExperts(layer.experts, layer.index, pool.buffers, self)

    # -- hooks ------------------------------------------------------------------------------

    def _on_forward(self, _module, args, kwargs):
        """Each forward of the model: hand its new input ids to the hash-building thread."""
        self._step += 1
        self._table_applied = self.builder is None
        if self.builder is not None:
            input_ids = kwargs.get("input_ids", args[0] if args else None)
            if input_ids is not None:
                cache = kwargs.get("past_key_values")
                new_sequence = cache is None or cache.get_seq_length() == 0
                self.builder.submit(self._step, input_ids, new_sequence)

    def _router_scores(self, layer: MoELayer):
        def hook(_module, _inputs, output):
            logits, _ = layer.adapter.routing(layer, output)
            probs = torch.softmax(logits.reshape(-1, logits.shape[-1]).float(), dim=-1).sum(0)
            self.cache.on_step(layer.index, probs.tolist())
        return hook

    def _on_evict(self, key: Key) -> None:
        self.engine.cancel(key)
        self.pool.map.release(key)

    # -- the inference thread's calls -------------------------------------------------------

    def _apply_table(self, layer: int) -> None:
        table = self.builder.poll(self._step)
        if table is None:
            if layer == 0:
                self.late_tables += 1
            return
        if layer == 0:
            self.tables_on_time += 1
        self._table_applied = True
        wanted: list[tuple[float, Key]] = []
        for later in range(layer + 1, len(self.layers)):
            scores = table.scores[later]
            top = torch.topk(scores, min(self.prefetch_per_layer, scores.numel()))
            # nearer layers first: they are needed sooner
            wanted += [(float(s) - later, (later, int(e))) for s, e in zip(top.values, top.indices)]
        wanted.sort(reverse=True)
        self.engine.cancel_stale(keep=[key for _, key in wanted])
        for priority, key in wanted:
            if self.cache.prefetch(key):
                self.engine.request(key, self.pool.map.assign(key), priority=priority)

    def acquire(self, layer: int, experts: list[int], device: torch.device) -> torch.Tensor:
        """Make `experts` of `layer` resident and pinned; return the layer's [E] expert → slot table."""
        if not self._table_applied:
            self._apply_table(layer)
        keys = [(layer, e) for e in experts]
        self.cache.access_many(keys, pin=True)
        self._in_use[layer] = keys
        for key in keys:
            if self.pool.map.slot_of(key) is None:
                self.engine.request(key, self.pool.map.assign(key), demand=True)
        for key in keys:
            self.engine.wait(key)
        return self.pool.map.table[layer].to(device)

    def release(self, layer: int) -> None:
        self.cache.unpin_many(self._in_use.pop(layer, []))

    # -- reporting and shutdown -------------------------------------------------------------

    def stats(self) -> RuntimeStats:
        c, t = self.cache.stats, self.engine.stats
        return RuntimeStats(
            accesses=c.accesses, hits=c.hits, misses=c.misses, prefetch_inserts=c.prefetch_inserts,
            prefetch_hits=c.prefetch_hits, wasted_prefetches=c.wasted_prefetches, evictions=c.evictions,
            prefetch_accuracy=c.prefetch_hits / c.prefetch_inserts if c.prefetch_inserts else 0.0,
            hit_rate=c.hit_rate, bytes_moved=t.bytes_moved, loads=t.loads, stall_seconds=round(t.stall_seconds, 4),
            late_tables=self.late_tables, tables_on_time=self.tables_on_time,
            slots=self.pool.num_slots, slot_bytes=self.pool.nbytes,
        )

    def close(self) -> None:
        """Stop every thread; safe to call twice."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        try:
            if self.builder is not None:
                self.builder.close()
        finally:
            self.engine.close()
            self.store.close()
