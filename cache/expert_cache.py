"""ExpertCache: which experts hold a fast-memory slot. It decides; it never copies weights.

The budget is `capacity` slots in all (global) or per layer (`per_layer=True`). A miss inserts
the key, evicting the policy's victim when the partition is full. Pinned keys (experts in use, a
pin count each) are never evicted, and a call never evicts its own keys: while `access_many` or
`prefetch_many` inserts, the other keys of the call are spared, so a miss or a prefetch never
pushes out an expert the same call needs.

The bookkeeping is compiled (`cache.kernel`, over the arrays of `cache.state`); this class owns
the lock, the numbering of keys, and the errors. One RLock guards everything: the runtime's
loader thread (prefetch) and inference thread (access, pin) share one cache. `replay` runs a
whole simulation through the same kernel functions (see `cache.simulator`).

`on_evict(key)` is called, under the lock, for each key the call evicted before it returns: the
runtime frees the slot there. It must not block, and it may read the cache but not insert into it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from cache import checks, kernel, state
from cache import replay as loops
from cache.errors import CacheError, CacheFullError, CapacityError
from cache.policy import EvictionPolicy, Key
from cache.rules import MARKED, on_forecast, on_router_scores

# A replay's forecasts: key ids, chances of use soon, chances of use by later tokens (None: not
# given), offsets per token-step.
Forecasts = tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]


@dataclass
class CacheStats:
    accesses: int = 0
    hits: int = 0
    misses: int = 0
    prefetch_inserts: int = 0
    prefetch_hits: int = 0  # accesses served by a prefetched entry not accessed before
    wasted_prefetches: int = 0  # prefetched entries evicted without being accessed
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0


class ExpertCache:
    """Slot bookkeeping for experts plus one eviction policy; thread-safe."""

    def __init__(
        self,
        capacity: int,
        policy: EvictionPolicy,
        per_layer: bool = False,
        n_layers: int | None = None,
        top_k: int | None = None,
        on_evict: Callable[[Key], None] | None = None,
        n_experts: int | None = None,
    ) -> None:
        """`capacity`: slots in all, or per layer if `per_layer`. `n_layers`, if given, bounds
        the layer of keys; with `n_experts` too, key (l, e) is numbered l·n_experts + e (what a
        replay's arrays use). `top_k`, if given, is checked: a layer's experts must fit."""
        where = "per layer" if per_layer else "in all"
        if top_k is not None and capacity < top_k:
            raise CapacityError(
                f"capacity {capacity} {where} cannot hold one layer's top-{top_k} experts; "
                f"the minimum is {top_k} slots {where}"
            )
        if capacity < 1:
            raise CapacityError(f"capacity {capacity} {where}: the minimum is 1 slot {where}")
        self.capacity = capacity
        self.policy = policy
        self.per_layer = per_layer
        self.n_layers = n_layers
        self.n_experts = n_experts
        self.top_k = top_k
        self.on_evict = on_evict
        self._lock = threading.RLock()
        self._keys: list[Key] = []  # id -> key
        self._ids: dict[Key, int] = {}  # key -> id
        params = np.zeros(state.N_PARAMS)
        params[[state.KIND, state.CAPACITY, state.PER_LAYER, state.LAYER_HEAPS]] = (
            policy.kind, capacity, per_layer, per_layer or policy.layer_heaps)
        params[[state.ALPHA, state.DECAY, state.TOP_P, state.MARKING]] = (
            policy.alpha, 1.0 - policy.alpha, policy.p, policy.marking)
        n_keys = (n_layers or 1) * (n_experts or 64)
        self.state = state.new_state(n_keys, n_layers or 1, params)
        self._stride = 0  # n_experts when every key is numbered l * n_experts + e
        if n_layers is not None and n_experts is not None:
            self.key_ids([(layer, e) for layer in range(n_layers) for e in range(n_experts)])
            self._stride = n_experts
        policy.attach(self)

    # -- key numbering ----------------------------------------------------------------------

    def key_ids(self, keys: Iterable[Key] | np.ndarray) -> np.ndarray:
        """The ids of `keys` (a sequence of (layer, expert), or an [M, 2] array), numbering the
        new ones."""
        if isinstance(keys, np.ndarray) and self._stride:
            layers, experts = keys.reshape(-1, 2).T
            if len(keys) == 0 or (layers.min() >= 0 and layers.max() < self.n_layers
                                  and experts.min() >= 0 and experts.max() < self._stride):
                return (layers * self._stride + experts).astype(np.int64)
        ids = self._ids
        if not isinstance(keys, np.ndarray):
            keys = list(keys)
            try:
                return np.array([ids[key] for key in keys], dtype=np.int64)
            except (KeyError, TypeError):
                pass
        pairs = checks.key_pairs(keys, self.n_layers, self.n_experts)
        with self._lock:
            return np.array([ids[key] if key in ids else self._number(key) for key in map(tuple, pairs.tolist())],
                            dtype=np.int64)

    def _number(self, key: Key) -> int:
        layer, expert = key
        if layer < 0 or expert < 0 or self.n_layers is not None and layer >= self.n_layers:
            raise CacheError(f"key {key} names layer {layer} but the cache has {self.n_layers} layers"
                             if layer >= 0 and expert >= 0 else f"key {key} has a negative layer or expert")
        key_id = len(self._keys)
        st = self.state
        if key_id >= len(st.order) or layer >= len(st.scale):
            self.state = st = state.grown(st, 2 * max(key_id, 32), 2 * layer + 1)
        st.order[key_id] = layer << 32 | expert
        st.layer[key_id] = layer
        st.outside[key_id] = self.policy.default_rank
        self._keys.append(key)
        self._ids[key] = key_id
        return key_id

    # -- queries ---------------------------------------------------------------------------

    @property
    def stats(self) -> CacheStats:
        """A snapshot of the counters. Every access that is not a miss hits, and every insertion
        fills a free slot or evicts one (nothing else removes a key)."""
        with self._lock:
            c = self.state.counters.tolist()
            inserts = c[state.MISSES] + c[state.PREFETCH_INSERTS]
            return CacheStats(
                accesses=c[state.ACCESSES], hits=c[state.ACCESSES] - c[state.MISSES], misses=c[state.MISSES],
                prefetch_inserts=c[state.PREFETCH_INSERTS], prefetch_hits=c[state.PREFETCH_HITS],
                wasted_prefetches=c[state.WASTED], evictions=inserts - c[state.RESIDENT],
            )

    def contains(self, key: Key) -> bool:
        """Whether `key` is resident now."""
        with self._lock:
            key_id = self._ids.get(key)
            return key_id is not None and bool(self.state.resident[key_id])

    __contains__ = contains

    def __len__(self) -> int:
        with self._lock:
            return int(self.state.counters[state.RESIDENT])

    def resident(self) -> frozenset[Key]:
        """The keys resident now."""
        with self._lock:
            keys = self._keys
            return frozenset(keys[i] for i in np.flatnonzero(self.state.resident[: len(keys)]).tolist())

    def eviction_order(self) -> list[Key]:
        """The keys resident now, the policy's next victim first (ties as the kernels break them;
        under LRU: least recently used first)."""
        with self._lock:
            st, keys = self.state, self._keys
            ids = np.flatnonzero(st.resident[: len(keys)])
            ids = ids[np.lexsort((st.order[ids], st.tiebreak[ids], st.rank[ids]))]
            return [keys[i] for i in ids.tolist()]

    def least_chance(self, spare: Sequence[Key] = ()) -> float | None:
        """Learned eviction: the lowest predicted chance of use soon among the resident keys that
        are neither pinned nor in `spare` (the next victim's, marks aside); None for a policy
        without forecasts or when no such key is resident."""
        if not self.policy.uses_forecasts:
            return None
        with self._lock:
            n = len(self._keys)
            st = self.state
            evictable = st.resident[:n] & (st.pins[:n] == 0)
            evictable[[self._ids[key] for key in spare if key in self._ids]] = False
            ranks = st.rank[:n][evictable]
            if not len(ranks):
                return None
            return float(np.where(ranks >= MARKED, ranks - MARKED, ranks).min())

    def pinned(self) -> dict[Key, int]:
        """Pinned keys and their pin counts."""
        with self._lock:
            pins = self.state.pins[: len(self._keys)]
            return {self._keys[i]: int(pins[i]) for i in np.flatnonzero(pins).tolist()}

    # -- demand path -----------------------------------------------------------------------

    def access(self, key: Key, score: float | None = None) -> bool:
        """Use `key`; True on a hit. A miss inserts it, evicting a victim if needed. (`score` is
        accepted for the interface's sake: router scores reach the policy through `on_step`.)

        Raises CacheFullError if the key's partition is full of pinned keys."""
        return self.access_many((key,)) == 0

    def access_many(self, keys: Sequence[Key], pin: bool = False) -> int:
        """Use `keys` (one layer-step's experts) in order; return the number of misses.

        A miss never evicts another key of the call; with `pin=True` the keys stay pinned
        afterwards (release with `unpin_many`). Raises CacheFullError, leaving pins as they
        were, if the keys and the pinned keys do not fit in a partition."""
        with self._lock:
            ids = self.key_ids(keys)
            inserted, evicted = np.empty_like(ids), np.empty_like(ids)
            n_inserted, n_evicted, failed, off = kernel.access_many(self.state.struct, ids, pin, inserted, evicted)
            self._evicted(evicted[:n_evicted])
            if failed >= 0:
                key = self._keys[ids[failed]]
                where = f"layer {key[0]}" if self.per_layer else "the cache"
                raise CacheFullError(
                    f"cannot insert {key}: all {self.capacity} slots of {where} are pinned or in use "
                    "by the same call; raise the capacity or unpin experts sooner"
                )
            self._check_sequence(ids, off)
            return n_inserted

    # -- prefetch path ---------------------------------------------------------------------

    def prefetch(self, key: Key, pin: bool = False) -> bool:
        """Insert `key` ahead of use (no access counted). False if it is already resident or
        its partition is full of pinned keys."""
        return bool(self.prefetch_many((key,), pin))

    def prefetch_many(self, keys: Iterable[Key], pin: bool = False) -> list[Key]:
        """`prefetch` keys in order (best first); return those inserted. No key of the call is
        evicted by the call, whether it was resident before or inserted by it: what does not fit
        is skipped. With `pin=True` the inserted keys stay pinned (while the loader fills them)."""
        with self._lock:
            ids = self.key_ids(keys)
            inserted, evicted = np.empty_like(ids), np.empty_like(ids)
            n_inserted, n_evicted = kernel.prefetch_many(self.state.struct, ids, pin, inserted, evicted)
            self._evicted(evicted[:n_evicted])
            return [self._keys[i] for i in inserted[:n_inserted].tolist()]

    # -- pins --------------------------------------------------------------------------------

    def pin(self, key: Key) -> None:
        """Protect a resident key from eviction until a matching `unpin`."""
        with self._lock:
            if key not in self:
                raise CacheError(f"cannot pin {key}: it is not resident; access or prefetch it first")
            self.state.pins[self._ids[key]] += 1

    def unpin(self, key: Key) -> None:
        """Release one pin of `key` (see `unpin_many`)."""
        self.unpin_many((key,))

    def unpin_many(self, keys: Sequence[Key]) -> None:
        """Release one pin of each key, so the policy may evict it again; a key that is not
        pinned is an error."""
        with self._lock:
            pins = self.state.pins
            ids = [self._ids.get(key) for key in keys]
            missing = [key for key, i in zip(keys, ids) if i is None or pins[i] == 0]
            if missing:
                raise CacheError(f"cannot unpin {missing}: not pinned")
            np.subtract.at(pins, ids, 1)

    def shrink(self, capacity: int) -> list[Key]:
        """Hold at most `capacity` keys from now on (per partition), evicting the policy's victims
        now (`on_evict` is called for each); returns them. Pinned keys stay, so a partition may
        hold more until they are unpinned and evicted by later insertions."""
        least = self.top_k or 1
        if capacity < least:
            raise CapacityError(f"capacity {capacity} cannot hold one layer's top-{least} experts")
        with self._lock:
            evicted = np.empty(max(int(self.state.fill.max()), 1), np.int64)
            n_evicted = kernel.shrink(self.state.struct, capacity, evicted)
            self.capacity = capacity
            self._evicted(evicted[:n_evicted])
            return [self._keys[i] for i in evicted[:n_evicted].tolist()]

    # -- policy hook -------------------------------------------------------------------------

    def on_forecast(self, chances: np.ndarray, layer: int | Sequence[int] | None = None) -> None:
        """Learned eviction: [L, E] predicted chances of use soon, each in [0, 1] (see
        `predictor.forecast.chances_of_use`), for every key of every layer; with `layer` (one or
        several), for those layers' keys only (a token has run the layer: pass the chances of use
        by later tokens)."""
        if not self.policy.uses_forecasts:
            return
        chances = np.asarray(chances, dtype=np.float64)
        if chances.ndim != 2:
            raise CacheError(f"forecast chances must be [layers, experts], got shape {list(chances.shape)}")
        layers = np.arange(chances.shape[0]) if layer is None else np.atleast_1d(np.asarray(layer, dtype=np.int64))
        ids = self._forecast_ids(layers, chances.shape[1])
        values = checks.chances(chances[layers].ravel())  # with `layer`: those rows alone are read (and checked)
        with self._lock:
            on_forecast(self.state.struct, ids, values)

    def _forecast_ids(self, layers: np.ndarray, n_experts: int) -> np.ndarray:
        """The ids of every expert of `layers`, as an array: numbered without a Python loop (the
        runtime calls `on_forecast` at every layer of every forward)."""
        if not len(layers):
            return np.zeros(0, dtype=np.int64)
        if self._stride == n_experts and 0 <= layers.min() and layers.max() < self.n_layers:
            return (layers[:, None] * n_experts + np.arange(n_experts)).ravel()
        pairs = np.stack([np.repeat(layers, n_experts), np.tile(np.arange(n_experts), len(layers))], axis=1)
        return self.key_ids(pairs)

    def on_step(self, layer: int, scores: Mapping[int, float] | Sequence[float]) -> None:
        """Forward one layer-step's router scores (expert -> score, or a dense vector over
        experts) to the policy (MRS uses them)."""
        if not self.policy.uses_scores:
            return
        items = list(scores.items()) if isinstance(scores, Mapping) else list(enumerate(scores))
        with self._lock:
            self.key_ids([(layer, 0)])  # checks the layer; the cache's arrays then cover it
            ids = self.key_ids([(layer, e) for e, _ in items])
            values = checks.scores(np.array([s for _, s in items], dtype=np.float64))
            on_router_scores(self.state.struct, layer, ids, values)

    # -- whole replays (the simulator) ---------------------------------------------------------

    def replay(self, n_layers: int, keys: np.ndarray, offsets: np.ndarray,
               scores: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
               predicted: tuple[np.ndarray, np.ndarray] | None = None,
               layers_ahead: int = 1, bandwidth: int | None = None,
               forecasts: Forecasts | None = None) -> int:
        """Run layer-steps j = t·n_layers + l through the cache: `keys[offsets[j]:offsets[j+1]]`
        are accessed (ids from `key_ids`), after router `scores` (key ids, values, offsets) reach
        the policy; with `predicted` (key ids, offsets) the predicted keys are prefetched `layers_ahead`
        layers early over a link moving `bandwidth` transfers per layer-step (None: instant);
        `forecasts` (key ids, chances of use, chances of use by later tokens or None, offsets per
        token-step) reach the policy as each token-step starts, the later chances of a layer's
        keys once the token-step has run that layer. The same as the per-call API driven step by
        step. Returns the late prefetches."""
        self._check_replay_args(n_layers, keys, offsets, scores, predicted, layers_ahead, forecasts)
        score_arrays, inserted, evicted = self._replay_buffers(offsets, scores, predicted)
        fc_arrays = _forecast_arrays(forecasts)
        with self._lock:
            if predicted is None:
                late, off = 0, loops.replay_demand(self.state.struct, n_layers, keys, offsets, *score_arrays,
                                                   scores is not None, *fc_arrays, inserted, evicted)
            else:
                late, off = loops.replay_prefetch(
                    self.state.struct, n_layers, keys, offsets, *score_arrays, scores is not None, *fc_arrays,
                    predicted[0], predicted[1], layers_ahead, -1 if bandwidth is None else bandwidth, inserted, evicted)
            self._check_replay(keys, off)
            return int(late)

    def replay_timed(self, n_layers: int, keys: np.ndarray, offsets: np.ndarray, compute_s: float,
                     transfer_s: float, scores: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
                     predicted: tuple[np.ndarray, np.ndarray] | None = None, layers_ahead: int = 1,
                     forecasts: Forecasts | None = None,
                     hide_only: bool = False,
                     next_predicted: tuple[np.ndarray, np.ndarray] | None = None,
                     copy_s: Sequence[float] | None = None, expert_s: float | None = None,
                     pipeline: bool = False) -> tuple[int, np.ndarray, np.ndarray]:
        """`replay` on a clock: each layer-step computes `compute_s` seconds once its experts are
        in, each expert's copy takes `transfer_s` on one link, demand loads ahead of prefetches
        (see `cache.simulator`). `copy_s`: a link keeping len(copy_s) copies in flight, one taking
        copy_s[n - 1] seconds when n run at once (`transfer_s` then the seconds per copy at full
        depth, for the hide-only rule); None: (transfer_s,). `pipeline`: each expert computes as it
        lands, `expert_s` (default `compute_s`) being the layer-step's expert compute. The cache's decisions are those of `replay`; with `hide_only` a
        prefetch is issued only if its copy can end before its layer starts. `next_predicted`
        (keys, offsets per layer-step (t, l): the keys forecast at token t for (t+1, l)) adds
        cross-token prefetch. Returns (late prefetches, clock [simulated s, link idle at, stall
        s], loads [demand, prefetch, wasted])."""
        self._check_replay_args(n_layers, keys, offsets, scores, predicted, layers_ahead, forecasts)
        if next_predicted is not None:
            if predicted is None:
                raise CacheError("cross-token prefetch (next_predicted) extends prefetching: give predicted too")
            with self._lock:
                checks.predicted_keys("next predicted", next_predicted, len(self._keys), len(offsets))
        copies = np.array([transfer_s] if copy_s is None else copy_s, np.float64)
        expert_s = compute_s if expert_s is None else expert_s
        checks.durations(compute_s=compute_s, transfer_s=transfer_s, expert_s=expert_s,
                         **{f"copy_s[{i}]": c for i, c in enumerate(copies)})
        if not len(copies) or expert_s > compute_s:
            raise CacheError(f"give one copy time or more (got {len(copies)}) and expert_s {expert_s} at most "
                             f"compute_s {compute_s}")
        score_arrays, inserted, evicted = self._replay_buffers(offsets, scores, predicted, next_predicted)
        none = (np.zeros(0, np.int64), np.zeros(1, np.int64))
        predicted_keys, predicted_offsets = predicted if predicted is not None else none
        next_keys, next_offsets = next_predicted if next_predicted is not None else none
        clock, transfers = np.zeros(3, np.float64), np.zeros(3, np.int64)
        with self._lock:
            late, off = loops.replay_timed(
                self.state.struct, n_layers, keys, offsets, *score_arrays, scores is not None,
                *_forecast_arrays(forecasts), predicted_keys, predicted_offsets, next_keys, next_offsets, layers_ahead,
                float(compute_s), float(expert_s), bool(pipeline), copies, float(transfer_s), bool(hide_only), inserted,
                evicted, clock, transfers)
            self._check_replay(keys, off)
            return int(late), clock, transfers

    # -- internals ---------------------------------------------------------------------------

    def _check_replay_args(self, n_layers: int, keys: np.ndarray, offsets: np.ndarray,
                           scores: tuple[np.ndarray, np.ndarray, np.ndarray] | None,
                           predicted: tuple[np.ndarray, np.ndarray] | None, layers_ahead: int,
                           forecasts: Forecasts | None) -> None:
        """A replay's arguments, checked so that the kernels stay inside their arrays."""
        with self._lock:
            checks.replay_arrays(n_layers, len(self.state.scale), len(self._keys), keys, offsets, scores,
                                 predicted, layers_ahead, forecasts)

    # -- internals (lock held) ---------------------------------------------------------------

    @staticmethod
    def _replay_buffers(offsets: np.ndarray, scores: tuple[np.ndarray, np.ndarray, np.ndarray] | None,
                        *predicted: tuple[np.ndarray, np.ndarray] | None) -> tuple[tuple, np.ndarray, np.ndarray]:
        """The score arrays (empty ones without scores) and the buffers of one call's changes."""
        empty_i, empty_f = np.zeros(1, np.int64), np.zeros(0, np.float64)
        score_arrays = scores if scores is not None else (empty_i, empty_f, empty_i)
        largest = max(int(np.diff(offsets).max(initial=0)), 1)  # the most keys one call inserts
        for keys_offsets in predicted:
            if keys_offsets is not None:
                largest = max(largest, int(np.diff(keys_offsets[1]).max(initial=0)))
        return score_arrays, np.empty(largest, np.int64), np.empty(largest, np.int64)

    def _check_replay(self, keys: np.ndarray, off: int) -> None:
        if off >= 0:
            raise self.policy.off_sequence(int(off), self._keys[keys[off]])

    def _evicted(self, ids: np.ndarray) -> None:
        if self.on_evict is not None:
            for key_id in ids.tolist():
                self.on_evict(self._keys[key_id])

    def _check_sequence(self, ids: np.ndarray, off: int) -> None:
        if off >= 0:
            position = int(self.state.counters[state.CURSOR])
            raise self.policy.off_sequence(position, self._keys[ids[off]])


def _forecast_arrays(forecasts: Forecasts | None) -> tuple[np.ndarray, ...]:
    """Forecast key ids, chances, later chances and per-token-step offsets; empty ones (no
    token-step, no later chances) where absent."""
    none = np.zeros(0, np.float64)
    if forecasts is None:
        return np.zeros(0, np.int64), none, none, np.zeros(1, np.int64)
    keys, soon, later, steps = forecasts
    return keys, soon, none if later is None else later, steps


def load_kernels(policy: EvictionPolicy, n_layers: int, n_experts: int, top_k: int) -> None:
    """Run the compiled kernels a serving cache calls (access, forecasts, prefetch, shrink) once on
    a throwaway cache with `policy`: numba's runtime and their machine code are then in the process,
    where a memory plan measuring it next counts them, as it must with or without a predictor (on
    runs/tb the plan's process grew from 379 to 406 MiB, results/bench-prediction-tb-costguard.json
    against -fused.json)."""
    cache = ExpertCache(max(top_k, 2), policy, n_layers=n_layers, top_k=top_k, n_experts=n_experts)
    keys = [(0, expert) for expert in range(min(top_k, n_experts))]
    cache.access_many(keys, pin=True)
    cache.unpin_many(keys)
    cache.on_forecast(np.zeros((n_layers, n_experts)))
    cache.prefetch_many([(n_layers - 1, n_experts - 1)])
    cache.shrink(top_k)
