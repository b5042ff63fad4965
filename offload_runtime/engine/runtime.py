"""OffloadRuntime: a transformers MoE model whose routed experts live in a slow tier.

Per forward of a stack (the model; an encoder-decoder's encoder and decoder apart, see
`prescient.arch.moe_stacks`), a pre-hook hands its new input ids, as that stack's token stream,
to the hash builder (SiDA's hash-building thread on a GPU host; inline on the CPU, see
`hash_builder`), and the prediction guard (`prediction_guard`) decides whether this forward acts on
predictions at all. Per MoE layer (inference thread), `arriving(layer, experts)` serves the
layer's selected experts: the cache decides hits and misses, each miss gets a slot and a demand
load, the forward's prefetches are topped up (`prefetch.Prefetcher`; with in-token lookahead,
`lookahead.InTokenLookahead`, the next layers' guesses from this block's input too), and the
model's own expert math runs on the slots (see `offloaded_experts`): the resident experts first,
each miss as its copy lands (the expert pipeline: Klotski's compute-while-loading order), or once all are in.
The cache decides residency; the slot map mirrors it: an insert takes a slot and requests its
copy, an eviction cancels a queued copy and frees the slot. A key evicted while its copy runs
and wanted again waits for that copy before it is requested into another slot.

Mixed precision (`fine_store`): the pool has a tier of fine slots and one of coarse ones, the
cache is a `cache.tiered.TieredCache` (a cache per tier, and the rule that picks each loaded
expert's copy), an insert takes a slot of its tier and the copy reads from that tier's store.

Serving (`offload_runtime.server`) batches sequences whose rows change from one forward to the
next: it runs each forward inside `rows(ids)` (one id per batch row), so that the predictor
keeps one state per sequence, and calls `end_sequences` when they finish. With
`RuntimeOptions.on_predictor_error` "demand" (what serve runs with) a failure of the hash-building
thread is logged and counted (`predictor_failures`) and the runtime goes on with demand loads
alone; by default it is raised.

Threads: the cache, slot map and this object are touched only by the inference thread (hooks
and experts modules run there); the transfer workers touch the pool and store, the
hash-building thread (if any) only the predictor. `close()` (or `with runtime:`) stops them all; a runtime
garbage-collected unclosed stops them then.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial

import torch
from torch import nn

from cache import EvictionPolicy, ExpertCache, Key, make_serving_policy
from cache.history import FORECAST_WEIGHT
from cache.tiered import TieredCache, tiered_cache
from offload_runtime.engine.hash_builder import HashBuilder, HashBuilderError
from offload_runtime.engine.hybrid import HybridCounts, HybridExperts
from offload_runtime.engine.offloaded_experts import offload_experts
from offload_runtime.engine.options import RuntimeOptions
from offload_runtime.engine.lookahead import InTokenLookahead
from offload_runtime.engine.memory_guard import MemoryGuard
from offload_runtime.engine.memory_plan import MemoryPlan
from offload_runtime.engine.prediction_guard import PredictionGuard, Spent
from offload_runtime.engine.prefetch import STEP_PRIORITY, Prefetcher
from offload_runtime.engine.slots import SlotPool, TieredSlotPool
from offload_runtime.engine.store import ExpertStore
from offload_runtime.engine.transfer import Ticket, TransferEngine
from predictor.artifact import load_predictor
from predictor.base import ExpertPredictor, PredictorError
from prescient.arch import MoELayer, moe_stacks
from prescient.fingerprint import ModelFingerprint

log = logging.getLogger(__name__)

@dataclass
class RuntimeStats:
    forwards: int  # of the stacks: an encoder-decoder's encoder and decoder forwards count apart
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
    demand_loads: int
    prefetch_loads: int
    stall_seconds: float  # inference thread blocked on loads
    late_tables: int  # forwards whose hash table was not ready when their first MoE layer ran
    tables_on_time: int
    slots: int
    slot_bytes: int
    predictor_failures: int = 0  # hash-building thread failures survived (on_predictor_error="demand")
    fine_accesses: int = 0  # mixed precision: accesses served by an expert's fine copy
    lookahead_prefetches: int = 0  # keys inserted by in-token lookahead (`RuntimeOptions.lookahead_layers`)
    # per MoE layer after each forward's first: whether the forward's hash table had been taken
    # while an earlier layer ran (its prefetches for the layer could start before it) or not
    table_layers_on_time: int = 0
    table_layers_late: int = 0
    table_wait_seconds: float = 0.0  # inference thread blocked waiting for hash tables (`table_wait`)
    where_it_lives: int = 0  # routed experts computed without a slot (`RuntimeOptions.hybrid_schedule`)
    slots_given_back: int = 0  # by the memory guard (`memory_guard`): the process re-read its own pages
    prediction_paused_forwards: int = 0  # forwards run with the predictor asleep (`prediction_guard`)
    prediction_probe_forwards: int = 0  # forwards run with the predictions in the guard's shadow only (probes)
    prediction_lost_windows: int = 0  # times predictions were paused: their loads or time passed a shadow LRU's
    predictor_seconds: float = 0.0  # the inference thread's time on predictions, bookkeeping included

    def to_dict(self) -> dict:
        return asdict(self)


class OffloadRuntime:
    """The runtime of an offloaded model (`LoadedModel.runtime`, made by `load_offloaded`): the
    expert cache over its slots, the transfer engine that fills them, the hash-building thread that
    predicts ahead. `stats()` counts hits, misses, prefetches and stalls (`RuntimeStats`);
    `memory_plan` is what the memory cap bought (None under a budget); `close()`, or leaving
    `with loaded:`, stops its threads."""

    def __init__(self, model: nn.Module, layers: list[MoELayer], store: ExpertStore, pool: SlotPool | TieredSlotPool,
                 fingerprint: ModelFingerprint, policy: EvictionPolicy, options: RuntimeOptions,
                 predictor: ExpertPredictor | None = None, fine_store: ExpertStore | None = None,
                 memory_plan: MemoryPlan | None = None) -> None:
        self.model, self.layers, self.store, self.pool = model, layers, store, pool
        self.fine_store = fine_store  # mixed precision: the fine copies, in `pool`'s first tier
        self.fingerprint = fingerprint  # computed once at load; CGOPipe checks predictors against it
        self.top_k = layers[0].top_k
        self.n_experts = layers[0].num_experts
        self.policy = policy
        self.cache = _expert_cache(pool, policy, options, layers, tiered=fine_store is not None, on_evict=self._on_evict)
        stores = [store] if fine_store is None else [fine_store, store]  # in the pool's tier order
        self.options = options
        # whether a layer's experts compute as their copies land (see `arriving`): the loaded option,
        # which a batch decoder switches for its schedule while it runs (`pipelining`)
        self.arrival_order = options.expert_pipeline
        self._step = -1
        self._tickets: dict[Key, Ticket] = {}
        self.sequence_ids: list | None = None  # serving: each batch row's sequence id, set by `rows`
        self.memory_plan = memory_plan  # with `RuntimeOptions.memory`: what the cap bought
        self.table_wait_seconds = 0.0  # SiDA's wait for hash tables (`RuntimeOptions.table_wait`, `_take_table`)
        self.predictor_failures = 0
        packed = list(zip(pool.tier_buffers(), [s.packed for s in stores])) if store.packed else None
        # HybriMoE's scheduler: on a GPU host it splits each layer between the GPU and the CPU, else admission
        self.hybrid = HybridExperts(store, pool, self.n_experts, self.top_k, split=pool.device.type == "cuda"
                                    ) if options.hybrid_schedule else None
        for layer in layers:  # the resident expert tensors are dropped with the old module
            layer.block.experts = layer.experts = offload_experts(layer, pool.tier_buffers()[0], self, packed=packed)
        stacks = moe_stacks(model, layers)
        self._handles = [stack.module.register_forward_pre_hook(self._on_forward(stream, stack.layers),
                                                                with_kwargs=True)
                         for stream, stack in enumerate(stacks)]
        tiered = fine_store is not None  # the precision rule reads router scores or forecasts too
        if getattr(self.policy, "uses_scores", False) or (tiered and self.cache.uses_scores):
            self._handles += [layer.router.register_forward_hook(self._router_scores(layer)) for layer in layers]
        self.engine = TransferEngine(stores, pool, workers=options.transfer_workers)
        self.lookahead = None if not options.lookahead_layers else InTokenLookahead(
            self, layers, [stack.layers for stack in stacks], options.lookahead_layers,
            options.prefetch_per_layer or self.top_k, STEP_PRIORITY, _probe(options, fingerprint))
        self.builder = None if predictor is None else HashBuilder(
            predictor, forecasts=policy.uses_forecasts or (tiered and self.cache.uses_forecasts),
            next_token=options.next_token_min_chance is not None,
            # on the CPU the predictor runs inline: a thread beside the inference thread took its turns at the
            # GIL, and cost the inference thread more than its own work (a profile of runs/tb at 0.85 GB)
            threaded=options.hash_thread if options.hash_thread is not None else pool.device.type == "cuda")
        self.predictor_seconds = 0.0  # the inference thread's time on predictions (see `_predicting`)
        # acts on predictions only while they load fewer experts than LRU would, in less time
        self.prediction_guard = PredictionGuard(self.cache, len(layers), self.n_experts, self.top_k, self._spent,
                                                self.builder.sleep, partial(make_serving_policy, options.policy,
                                                                            self.top_k)) \
            if predictor is not None and options.prediction_guard and fine_store is None \
            and not options.hybrid_schedule else None  # HybriMoE's scheduler decides on the forecasts itself
        self.prefetcher = Prefetcher(self.prediction_guard or self.cache, self.engine, len(layers), self.n_experts,
                                     _prefetch_per_layer(options, self.top_k, pool.device, policy.uses_forecasts), options,
                                     self.top_k, forecast_weight=1.0 if predictor is not None and predictor.certain else FORECAST_WEIGHT)
        # under `--memory`, slots are given back if the process starts re-reading its own pages
        self.guard = MemoryGuard(self._give_back_slots, pool.num_slots, self.top_k) \
            if options.memory is not None and fine_store is None else None
        self._stop = weakref.finalize(self, _stop_threads, self.engine, self.builder, stores)

    @property
    def step(self) -> int:
        """The number of the model's current (or last) forward, from 0; -1 before the first."""
        return self._step

    @contextmanager
    def rows(self, ids: list) -> Iterator[None]:
        """Serving: the forwards run inside are over batch rows of the sequences `ids` (one per
        row), so that the predictor keeps one state per sequence (see the module doc)."""
        before, self.sequence_ids = self.sequence_ids, list(ids)
        try:
            yield
        finally:
            self.sequence_ids = before

    @contextmanager
    def pipelining(self, on: bool) -> Iterator[None]:
        """Inside, a layer's experts compute as their copies land (`on`), or once all are in, whatever
        `RuntimeOptions.expert_pipeline` says: a batch decoder's schedule (`cgopipe.zigzag`)."""
        before, self.arrival_order = self.arrival_order, on
        try:
            yield
        finally:
            self.arrival_order = before

    # -- hooks ------------------------------------------------------------------------------

    def _on_forward(self, stream: int, layers: range):
        """Each forward of a stack: a new step over its layers; hand its new input ids to the hash
        builder as token stream `stream`."""
        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            if self.prefetcher.unsent:
                with self._predicting():  # a predictor's bookkeeping is its cost too
                    self.prefetcher.send_forecasts()  # the last forward's, before the guards may evict or clear ranks
            if self.guard is not None:
                self.guard.check()
            # transformers 5.24 renamed the forward's `past_key_values` to `cache`; without a predictor nothing asks
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            new_sequence = self.builder is not None and (cache is None or cache.get_seq_length() == 0)
            if self.prediction_guard is not None:
                with self._predicting():
                    if new_sequence and self.sequence_ids is None:
                        self.prediction_guard.start_sequence()
                    else:
                        self.prediction_guard.on_forward()
            self._step += 1
            self.prefetcher.start(self._step, layers)
            if self.builder is None:
                return
            input_ids = kwargs["input_ids"] if "input_ids" in kwargs else (args[0] if args else None)
            if input_ids is None:  # inputs_embeds: nothing to hash, this forward's table never comes
                return
            try:
                with self._predicting():
                    self.builder.submit(self._step, input_ids, new_sequence, kwargs.get("attention_mask"), stream,
                                        rows=self.sequence_ids)
            except HashBuilderError as exc:
                self._predictor_failed(exc)
        return hook

    @contextmanager
    def _predicting(self) -> Iterator[None]:
        """Time the inference thread spends on predictions, their bookkeeping included (the
        prediction guard weighs it)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.predictor_seconds += time.perf_counter() - start

    def _spent(self) -> Spent:
        t = self.engine.stats
        return Spent(t.stall_seconds, t.demand_loads, self.predictor_seconds, t.copy_seconds, t.loads)

    def _predictor_failed(self, exc: HashBuilderError) -> None:
        if self.options.on_predictor_error != "demand":
            raise exc
        log.error("%s; serving goes on with demand loads only", exc)
        self.predictor_failures += 1
        self.builder.close()
        self.builder = None

    def end_sequences(self, ids: list) -> None:
        """Serving: the sequences `ids` ended; their predictor states go."""
        if self.builder is not None:
            self.builder.forget(ids)

    def _router_scores(self, layer: MoELayer):
        """MRS: the layer's router probabilities, summed over the forward's tokens, reach the
        policy before the layer's experts are accessed."""
        def hook(_module: nn.Module, _inputs: tuple, output) -> None:
            logits, _ = layer.adapter.routing(layer, output)
            probs = torch.softmax(logits.reshape(-1, logits.shape[-1]), dim=-1).sum(0)
            self.cache.on_step(layer.index, probs.tolist())
        return hook

    def _give_back_slots(self, count: int) -> int:
        """The memory guard's call: hold `count` fewer experts, evicting the policy's victims, and
        hand those slots' pages back to the kernel; returns the bytes freed."""
        self.prefetcher.send_forecasts()
        evicted = self.cache.shrink(self.cache.capacity - count)
        if self.prediction_guard is not None:
            self.prediction_guard.shrink(self.cache.capacity)
        copying = [t.future for t in (self._tickets.get(key) for key in evicted) if t is not None]
        futures.wait(copying)  # a copy still running into a slot would touch its pages again
        return self.pool.give_back(count)

    def _on_evict(self, key: Key) -> None:
        self.engine.cancel(key)
        self.pool.map.release(key)

    # -- the inference thread's calls -------------------------------------------------------

    def arriving(self, layer: int, experts: list[int], device: torch.device, as_they_land: bool = True,
                 loads: list[int] | None = None) -> Iterator[tuple[list[int], torch.Tensor | None]]:
        """The one way an experts module asks for `experts` of `layer` (mixtral-offloading's shape:
        a layer's experts yielded as they land): groups of them, each with the layer's [E] expert
        → slot table (-1: no slot) while the group is resident and pinned; at least one group (an
        empty one for no experts). With `loads` (the tokens routed to each) and HybriMoE's
        scheduler on, first the experts that compute where they live, without a slot (table None:
        `hybrid.HybridExperts.decide`, from whether each holds a slot, the cache and the forward's
        chances of use by later tokens), then the others'.

        All in one group, in the order given, once their copies are in, where they fit the slots and
        either every copy has landed already or they do not compute as they land (`as_they_land`
        False, or `arrival_order` off): one call of the experts code then computes the layer. Else the
        resident ones first, at most the slot count made resident at a time (a long prefill under a
        small budget); with `arrival_order` (EPS-MoE's expert pipeline, `RuntimeOptions.expert_pipeline`;
        the batch decoders set it with `pipelining`) the experts whose copies have landed compute while the others'
        copies run, then each as it lands (Klotski's order); without it, a group once all its
        copies are in."""
        if loads is not None and self.hybrid is not None:
            lives = self._where_it_lives(layer, experts, loads)
            yield lives, None
            experts = [e for e in experts if e not in lives]
        room = self.pool.num_slots - self.pool.map.retired
        pipelined = self.arrival_order and as_they_land
        if len(experts) <= room and not (pipelined and not self._all_landed(layer, experts)):
            with self._use(layer, experts, device) as slots:
                yield experts, slots
            return
        resident_first = sorted(experts, key=lambda e: self.pool.map.slot_of((layer, e)) is None)
        for start in range(0, len(resident_first), room):
            part = resident_first[start:start + room]
            with self._use(layer, part, device, wait=not pipelined) as slots:
                if not pipelined:
                    yield part, slots
                    continue
                waiting = [(layer, e) for e in part]
                while waiting:
                    landed = [key for key in waiting if self.engine.ready(key)] or self.engine.wait_any(waiting)
                    for key in landed:
                        self.engine.wait(key)  # a CUDA copy's event; re-raises a failed copy
                    waiting = [key for key in waiting if key not in landed]
                    yield [e for _, e in landed], slots

    @contextmanager
    def _use(self, layer: int, experts: list[int], device: torch.device, wait: bool = True) -> Iterator[torch.Tensor]:
        """Make `experts` of `layer` resident and pinned while the block runs; yields the
        layer's [E] expert → slot table (-1: no slot). `wait=False`: the copies may still run."""
        keys = [(layer, e) for e in experts]
        if self.prefetcher.unsent and (layer in self.prefetcher.unsent
                                       or any(self.pool.map.rows[layer][e] < 0 for e in experts)):
            with self._predicting():
                self.prefetcher.send_forecasts()  # the ranks this access reads, or its misses evict by
        # the decision: the cache counts each hit and miss, inserts the misses (evicting what its
        # policy chooses: `_on_evict` cancels the victim's queued copy and frees its slot) and
        # pins every key, so nothing this layer needs is evicted while it runs
        self.cache.access_many(keys, pin=True)
        if self.builder is not None or self.prediction_guard is not None:
            with self._predicting():  # what predicting costs beside the predictor's own work:
                if self.builder is not None:  # the history learned eviction blends in (nothing reads it without tables)
                    self.prefetcher.used(layer, experts)
                if self.prediction_guard is not None:  # and the guard's LRU shadow
                    self.prediction_guard.access(keys)
        try:
            # the copy: each miss (a key without a slot) gets one and a demand load, which the
            # transfer engine serves ahead of every prefetch
            row = self.pool.map.rows[layer]  # read without the map's lock: this thread alone writes it
            missing = [key for key in keys if row[key[1]] < 0]
            for key in missing:
                self._load(key, demand=True)
            if self.lookahead is not None:  # the next layers' routers on this block's input
                self.lookahead.issue(layer)
            guard = self.prediction_guard
            if self.builder is not None and (guard is None or guard.acting or guard.shadowing):
                with self._predicting():  # meanwhile, the predicted experts of the layers ahead
                    self._prefetch_after(layer, len(missing))
            for key in keys if wait else ():  # the layer computes once its experts are in
                if not self._landed(key):  # a copy done (the common case) needs no engine call
                    self.engine.wait(key)
            table = self.pool.map.table[layer]
            # on the CPU the row itself: each caller indexes it at once, and no slot changes while
            # the layer runs (only this thread assigns them)
            yield table if table.device == device else table.to(device)
        finally:
            if self.pool.device.type == "cuda":  # the layer's reads are enqueued: a later copy into a slot waits
                row = self.pool.map.rows[layer]
                self.engine.used([int(row[e]) for _, e in keys if row[e] >= 0])
            self.cache.unpin_many(keys)

    def _landed(self, key: Key) -> bool:
        """Whether `key`'s last requested copy is done and did not fail (see `Ticket.ready`)."""
        ticket = self._tickets.get(key)
        return ticket is not None and ticket.ready()

    def _all_landed(self, layer: int, experts: list[int]) -> bool:
        """Whether every one of `experts` of `layer` is in its slot, its copy done (an evicted
        expert's last copy is done too, but it has no slot)."""
        row = self.pool.map.rows[layer]
        return all(row[e] >= 0 and self._landed((layer, e)) for e in experts)

    def _where_it_lives(self, layer: int, experts: list[int], loads: list[int]) -> list[int]:
        """Of `experts` of `layer` (`loads`: the tokens routed to each), those HybriMoE's scheduler
        computes where they live (see `arriving`); the forward's hash table first, if it is ready."""
        if self.builder is not None and self.prefetcher.wanted is None:
            self._take_table(layer)
        self.prefetcher.send_forecasts()  # the ranks it decides by
        row = self.pool.map.rows[layer]
        return self.hybrid.decide(layer, experts, loads, [bool(row[e] >= 0) for e in experts], self.cache,
                                  self.prefetcher.later)

    def prefetch(self, keys: list[Key], priority: float = 0.0) -> list[Key]:
        """Insert `keys` that are not resident (a prefetch: not an access; none of `keys` is
        evicted for another) and request their copies in the given order, after every demand
        load; returns the keys inserted."""
        self.prefetcher.send_forecasts()  # the ranks it evicts by
        inserted = self.cache.prefetch_many(keys)
        for rank, key in enumerate(inserted):
            self._load(key, priority=priority - rank)
        return inserted

    def pin_resident(self, keys: list[Key]) -> None:
        """Load `keys` and keep them resident for good (pinned: never evicted)."""
        self.prefetcher.send_forecasts()
        inserted = self.cache.prefetch_many(keys, pin=True)  # pins what it inserts
        for key in inserted:
            self._load(key)
        for key in set(keys) - set(inserted):  # already resident
            self.cache.pin(key)
        for key in keys:
            self.engine.wait(key)

    def _load(self, key: Key, demand: bool = False, priority: float = 0.0) -> None:
        """Give inserted `key` a slot (of the tier whose cache holds it) and request its copy."""
        slot = self.pool.map.assign(key, 0 if self.fine_store is None else self.cache.tier_of(key))
        old = self._tickets.get(key)
        if old is not None and old.slot != slot and not old.future.done():
            futures.wait([old.future])  # evicted while copying into its old slot: let that copy end
        self._tickets[key] = self.engine.request(key, slot, priority=priority, demand=demand)

    def _prefetch_after(self, layer: int, demand_loads: int = 0) -> None:
        """Prefetch what the forward's hash table predicts beyond `layer`, once the table is ready
        (see `prefetch.Prefetcher`); `demand_loads`: the misses `layer` just requested."""
        plan = self.prefetcher
        if plan.wanted is None and not self._take_table(layer):
            return
        keys = plan.keys_after(layer, demand_loads)  # the forecasts reach the cache (through the guard)
        if self.prediction_guard is not None and not self.prediction_guard.acting:
            self.prediction_guard.prefetch(keys)  # a probe: into the guard's shadow, nothing copied
            return
        rows = self.pool.map.rows
        if keys and any(rows[key] < 0 for key in keys):  # all resident: the call would insert nothing
            plan.issued(self.prefetch(keys, priority=plan.priority))

    def _take_table(self, layer: int) -> bool:
        """Take the forward's hash table if it is ready (SiDA's wait at its first layer); False if
        the hash-building thread failed (and serving goes on without it). At a forward's first MoE
        layer it waits up to `table_wait` seconds (0: never; a late table then serves only the layers
        after the one it lands in)."""
        wait = self.options.table_wait
        try:
            table = self.builder.poll(self._step)
            if table is None and wait > 0 and layer == self.prefetcher.layers.start:
                start = time.perf_counter()
                table = self.builder.wait(self._step, wait)
                self.table_wait_seconds += time.perf_counter() - start
        except HashBuilderError as exc:
            self._predictor_failed(exc)
            return False
        if table is not None:
            self.prefetcher.take(table, layer)
            if self.fine_store is not None and table.later_chances is not None:
                self.cache.on_later(table.later_chances.numpy())
        return True

    # -- reporting and shutdown -------------------------------------------------------------

    def stats(self) -> RuntimeStats:
        """Everything counted since the model loaded: hits, misses, prefetches, bytes moved, stalls."""
        c, t = self.cache.stats, self.engine.stats
        h = self.hybrid.counts if self.hybrid is not None else HybridCounts()
        # an expert computed where it lives is an access the cache did not see: a miss unless it held a slot
        accesses, misses = c.accesses + h.computed, c.misses + h.misses
        return RuntimeStats(
            forwards=self._step + 1, accesses=accesses, hits=accesses - misses, misses=misses,
            prefetch_inserts=c.prefetch_inserts, prefetch_hits=c.prefetch_hits,
            wasted_prefetches=c.wasted_prefetches, evictions=c.evictions,
            prefetch_accuracy=c.prefetch_hits / c.prefetch_inserts if c.prefetch_inserts else 0.0,
            hit_rate=(accesses - misses) / accesses if accesses else 0.0, bytes_moved=t.bytes_moved, loads=t.loads, demand_loads=t.demand_loads,
            prefetch_loads=t.prefetch_loads, stall_seconds=round(t.stall_seconds, 4),
            late_tables=self.prefetcher.late_tables, tables_on_time=self.prefetcher.tables_on_time,
            slots=self.pool.num_slots - self.pool.map.retired,
            slot_bytes=self.pool.nbytes * (self.pool.num_slots - self.pool.map.retired) // self.pool.num_slots,
            slots_given_back=self.guard.given_back if self.guard is not None else 0,
            prediction_paused_forwards=self.prediction_guard.paused_forwards if self.prediction_guard else 0,
            prediction_probe_forwards=self.prediction_guard.probe_forwards if self.prediction_guard else 0,
            prediction_lost_windows=self.prediction_guard.lost_windows if self.prediction_guard else 0,
            predictor_seconds=round(self.predictor_seconds, 4),
            predictor_failures=self.predictor_failures,
            fine_accesses=self.cache.fine_accesses if self.fine_store is not None else 0,
            lookahead_prefetches=self.lookahead.issued if self.lookahead is not None else 0,
            table_layers_on_time=self.prefetcher.layers_on_time, table_layers_late=self.prefetcher.layers_late,
            table_wait_seconds=round(self.table_wait_seconds, 4), where_it_lives=h.computed,
        )

    def close(self) -> None:
        """Stop every thread and close the store; safe to call twice. The model cannot run after."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self.lookahead is not None:
            self.lookahead.remove()
        if self.hybrid is not None:
            self.hybrid.close()
        self._stop()

    def __enter__(self) -> "OffloadRuntime":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _expert_cache(pool: SlotPool | TieredSlotPool, policy: EvictionPolicy, options: RuntimeOptions,
                  layers: list[MoELayer], tiered: bool, on_evict: Callable[[Key], None]) -> ExpertCache | TieredCache:
    """The cache that decides residency over `pool`'s slots: one `ExpertCache`, or with mixed
    precision (`tiered`) a cache per tier of slots, each with its own instance of the policy."""
    top_k = layers[0].top_k
    if tiered:
        policies = [policy, make_serving_policy(options.policy, top_k)]
        return tiered_cache([p.num_slots for p in pool.pools], policies, options.precision_rule, len(layers),
                            layers[0].num_experts, top_k, on_evict)
    # with n_experts every key is numbered arithmetically: learned eviction renews a layer's
    # chances at every layer of every forward, and a lookup and check per key cost more than the kernel
    return ExpertCache(pool.num_slots, policy, n_layers=len(layers), top_k=top_k, on_evict=on_evict,
                       n_experts=max(layer.num_experts for layer in layers))


def _prefetch_per_layer(options: RuntimeOptions, top_k: int, device: torch.device, learned: bool) -> int:
    """Experts prefetched per layer and predicted token (in-token prefetch): as given; by default the
    top-k (SiDA's prefetch), but none on the CPU where the forecasts rank evictions (`learned`).
    There a prefetch is a disk read that displaces a resident expert, and the forecasts do better
    keeping the right experts than fetching new ones: over runs/tb's 8 held-out prompts at 17 and 33
    slots, the runtime loaded more experts with in-token prefetch than without it on 7 and 8 of them
    (results/bench-prediction-tb-history.json measures both). Cross-token prefetch, by its forecast
    chances, is apart: `Prefetcher._next_keys`."""
    if options.prefetch_per_layer is not None:
        return options.prefetch_per_layer
    return 0 if device.type != "cuda" and learned else top_k


def _probe(options: RuntimeOptions, fingerprint: ModelFingerprint):
    """The trained probe that guesses for in-token lookahead, on the slots' device; None: the routers."""
    if options.lookahead_probe is None:
        return None
    from predictor.probe import ProbeLookahead

    probe = load_predictor(options.lookahead_probe, fingerprint=fingerprint)
    if not isinstance(probe, ProbeLookahead):
        raise PredictorError(f"{options.lookahead_probe} holds a {probe.kind!r} predictor, not a lookahead probe; "
                             "train one with `prescient train --config configs/predictor/probe.yaml`")
    if probe.max_ahead < options.lookahead_layers:
        raise PredictorError(f"the probe {options.lookahead_probe} looks {probe.max_ahead} layer(s) ahead, not "
                             f"{options.lookahead_layers}; lower --lookahead or train it with --model.ahead "
                             f"{options.lookahead_layers}")
    probe.heads.to(options.device)
    return probe.lookahead


def _stop_threads(engine: TransferEngine, builder: HashBuilder | None, stores: list[ExpertStore]) -> None:
    """Stop the hash-building and transfer threads, then close the store. Run by `close()`, or by
    the garbage collector for a runtime never closed: if that happens on one of the threads to
    stop, which cannot join itself, a thread of its own does the stopping."""
    if threading.current_thread().name.startswith(("expert-transfer", "hash-builder")):
        threading.Thread(target=_stop_threads, args=(engine, builder, stores), name="runtime-stop", daemon=True).start()
        return
    try:
        if builder is not None:
            builder.close()
    finally:
        engine.close()
        for store in stores:
            store.close()
