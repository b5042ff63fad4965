"""ExpertCache: which experts hold a fast-memory slot. It decides; it never copies weights.

The budget is `capacity` slots in all (global) or per layer (`per_layer=True`). A miss inserts
the key, evicting the policy's victim when the partition is full. Pinned keys (experts in use, a
pin count each) are never evicted. One RLock guards everything: the runtime's loader thread
(prefetch) and inference thread (access, pin) share one cache.

A call never evicts its own keys: while `access_many` or `prefetch_many` inserts, the other keys
of the call are spared as if pinned (a victim among them is rare, and only then are they pinned
for a second ask), so a miss or a prefetch never pushes out an expert the same call needs.

`on_evict(key)` is called, under the lock, after each eviction: the runtime frees the slot there,
the simulator cancels the key's transfer. It must not block, and it may read the cache but not
insert into it (the calling insertion's spared keys are not pinned).

`access_steps` (a whole demand replay) and `access_and_prefetch` (one layer-step with the loader
ahead) are the simulator's bulk forms of the same calls: one lock, and `access_steps` tells the
policy of uses in one call per stretch without insertions. Hits and evictions are derived from
the other counters (see `stats`) rather than counted on the hot path.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import repeat
from typing import NoReturn

from cache.errors import CacheError, CacheFullError, CapacityError
from cache.policy import Candidates, EvictionPolicy, Key, Partition


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
    ) -> None:
        """`capacity`: slots in all, or per layer if `per_layer`. `n_layers`, if given, bounds
        the layer of inserted keys. `top_k`, if given, is checked: a layer's experts must fit."""
        where = "per layer" if per_layer else "in all"
        if top_k is not None and capacity < top_k:
            raise CapacityError(
                f"capacity {capacity} {where} cannot hold one layer's top-{top_k} experts; "
                f"the minimum is {top_k} slots {where}"
            )
        if capacity < 1:
            raise CapacityError(f"capacity {capacity} {where}: the minimum is 1 slot {where}")
        policy.attach(per_layer)
        self.capacity = capacity
        self.policy = policy
        self.per_layer = per_layer
        self.n_layers = n_layers
        self.top_k = top_k
        self.on_evict = on_evict
        self._lock = threading.RLock()
        self._stats = CacheStats()
        self._resident: set[Key] = set()
        self._fill: dict[Partition, int] = {}  # keys in each partition that is not full yet
        self._full: dict[Partition, Candidates] = {}  # full partitions: their evictable keys
        self._pins: dict[Key, int] = {}
        self._unused_prefetches: set[Key] = set()

    # -- queries ---------------------------------------------------------------------------

    @property
    def stats(self) -> CacheStats:
        """A snapshot of the counters. Hits and evictions are derived, not counted on the hot
        path: every access that is not a miss hits, and every insertion fills a free slot or
        evicts one (nothing else removes a key)."""
        with self._lock:
            s = self._stats
            inserts = s.misses + s.prefetch_inserts
            return replace(s, hits=s.accesses - s.misses, evictions=inserts - len(self._resident))

    def contains(self, key: Key) -> bool:
        with self._lock:
            return key in self._resident

    __contains__ = contains

    def __len__(self) -> int:
        with self._lock:
            return len(self._resident)

    def resident(self) -> frozenset[Key]:
        with self._lock:
            return frozenset(self._resident)

    def pinned(self) -> dict[Key, int]:
        """Pinned keys and their pin counts."""
        with self._lock:
            return dict(self._pins)

    # -- demand path -----------------------------------------------------------------------

    def access(self, key: Key, score: float | None = None) -> bool:
        """Use `key`; True on a hit. A miss inserts it, evicting a victim if needed.

        Raises CacheFullError if the key's partition is full of pinned keys."""
        with self._lock:
            hit = key in self._resident
            if hit:
                if key in self._unused_prefetches:
                    self._unused_prefetches.discard(key)
                    self._stats.prefetch_hits += 1
            else:
                self._load((key,), (), demand=True)
            self._stats.accesses += 1
            self.policy.on_access(key, score)
            return hit

    def access_many(self, keys: Sequence[Key], pin: bool = False) -> int:
        """Use `keys` (one layer-step's experts) in order; return the number of misses.

        A miss never evicts another key of the call; with `pin=True` the keys stay pinned
        afterwards (release with `unpin_many`). Raises CacheFullError, leaving pins as they
        were, if the keys and the pinned keys do not fit in a partition."""
        with self._lock:
            misses = 0 if self._resident.issuperset(keys) else len(self._load(keys, keys, demand=True))
            self._use(keys)
            if pin:
                pins = self._pins
                for key in keys:
                    pins[key] = pins.get(key, 0) + 1
            return misses

    def access_steps(
        self,
        steps: Iterable[Sequence[Sequence[Key]]],
        scores: Iterable[Sequence[Mapping[int, float] | Sequence[float]]] | None = None,
    ) -> int:
        """Decode token-steps in order: for each step, for each layer l, `on_step(l, scores[t][l])`
        (if `scores` is given), then `access_many(steps[t][l])`. The same as those calls one by
        one, under one lock (the simulator's demand replay). Returns the number of misses.

        The uses reach the policy in one `on_access_many` per stretch without an insertion or a
        step: the policy sees the same calls in the same order, joined."""
        with self._lock:
            issuperset, load = self._resident.issuperset, self._load
            on_uses, on_step = self.policy.on_access_many, self.policy.on_step
            unused = self._unused_prefetches
            uses: list[Key] = []  # keys used since the policy last heard of a use
            accessed = misses = 0
            try:
                for step, step_scores in zip(steps, scores if scores is not None else repeat(None)):
                    for layer, keys in enumerate(step):
                        if step_scores is not None:
                            if uses:
                                used, uses = uses, []
                                on_uses(used)
                            on_step(layer, step_scores[layer])
                        if not issuperset(keys):
                            if uses:
                                used, uses = uses, []
                                on_uses(used)
                            misses += len(load(keys, keys, demand=True))
                        if unused:
                            self._count_prefetch_hits(keys)
                        uses += keys
                        accessed += len(keys)
            finally:
                self._stats.accesses += accessed
                if uses:
                    on_uses(uses)
            return misses

    # -- prefetch path ---------------------------------------------------------------------

    def prefetch(self, key: Key, pin: bool = False) -> bool:
        """Insert `key` ahead of use (no access counted). False if it is already resident or
        its partition is full of pinned keys."""
        return bool(self.prefetch_many((key,), pin))

    def prefetch_many(self, keys: Iterable[Key], pin: bool = False) -> list[Key]:
        """`prefetch` keys in order (best first); return those inserted. No key of the call is
        evicted by the call, whether it was resident before or inserted by it: what does not fit
        is skipped. With `pin=True` the inserted keys stay pinned (while the loader fills them)."""
        keys = keys if isinstance(keys, (list, tuple)) else list(keys)
        with self._lock:
            if self._resident.issuperset(keys):
                return []
            inserted = self._load(keys, keys, demand=False)
            if pin:
                pins = self._pins
                for key in inserted:
                    pins[key] = pins.get(key, 0) + 1
            return inserted

    def access_and_prefetch(self, keys: Sequence[Key], prefetch_keys: Sequence[Key]) -> tuple[int, list[Key]]:
        """One layer-step with the loader running ahead: `access_many(keys, pin=True)`, then
        `prefetch_many(prefetch_keys)` while `keys` are pinned, then `unpin_many(keys)`; the
        same as those three calls, under one lock. Returns (misses, keys prefetched)."""
        with self._lock:
            resident = self._resident
            misses = 0 if resident.issuperset(keys) else len(self._load(keys, keys, demand=True))
            self._use(keys)
            if resident.issuperset(prefetch_keys):
                return misses, []
            return misses, self._load(prefetch_keys, (*keys, *prefetch_keys), demand=False)

    # -- pins --------------------------------------------------------------------------------

    def pin(self, key: Key) -> None:
        """Protect a resident key from eviction until a matching `unpin`."""
        with self._lock:
            if key not in self._resident:
                raise CacheError(f"cannot pin {key}: it is not resident; access or prefetch it first")
            self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, key: Key) -> None:
        with self._lock:
            if key not in self._pins:
                raise CacheError(f"cannot unpin {key}: it is not pinned")
            self._release((key,))

    def unpin_many(self, keys: Sequence[Key]) -> None:
        with self._lock:
            pins = self._pins
            for key in keys:
                if key not in pins:
                    missing = [key for key in keys if key not in pins]
                    raise CacheError(f"cannot unpin {missing}: not pinned")
            self._release(keys)

    # -- policy hook -------------------------------------------------------------------------

    def on_step(self, layer: int, scores: Mapping[int, float] | Sequence[float]) -> None:
        """Forward one layer-step's router scores to the policy (MRS uses them)."""
        with self._lock:
            self.policy.on_step(layer, scores)

    # -- internals (lock held) ---------------------------------------------------------------

    def _use(self, keys: Sequence[Key]) -> None:
        """Resident `keys` are used: count them and tell the policy."""
        if self._unused_prefetches:
            self._count_prefetch_hits(keys)
        self._stats.accesses += len(keys)
        self.policy.on_access_many(keys)

    def _count_prefetch_hits(self, keys: Sequence[Key]) -> None:
        """Resident `keys` are being used: those prefetched and not used before count once."""
        unused = self._unused_prefetches
        if not unused.isdisjoint(keys):
            used = unused.intersection(keys)
            unused -= used
            self._stats.prefetch_hits += len(used)

    def _load(self, keys: Sequence[Key], busy: Sequence[Key], demand: bool) -> list[Key]:
        """Insert the keys that are not resident, in order, and return them. Where a partition is
        full, the policy's victim goes; it is never pinned nor one of `busy` (the keys of the
        call). A key that finds no victim raises CacheFullError if `demand` (the keys before it
        are used: counted and reported), else is skipped. The only place keys are evicted."""
        resident, policy, full, unused = self._resident, self.policy, self._full, self._unused_prefetches
        n_layers, per_layer = self.n_layers, self.per_layer
        inserted: list[Key] = []
        try:
            for key in keys:
                if key in resident:
                    continue
                if n_layers is not None and not 0 <= key[0] < n_layers:
                    raise CacheError(f"key {key} names layer {key[0]} but the cache has {n_layers} layers")
                part = key[0] if per_layer else None
                candidates = full.get(part)
                if candidates is None:  # a free slot
                    fill = self._fill[part] = self._fill.get(part, 0) + 1
                    if fill == self.capacity:
                        full[part] = Candidates(part, self._pins)
                else:  # one out, one in
                    victim = policy.victim(candidates)
                    if victim in busy:  # rare: ask again with the call's keys pinned
                        victim = self._victim_sparing(candidates, busy)
                    if victim is None:
                        if demand:
                            self._fail(key, keys)
                        continue
                    resident.remove(victim)
                    policy.on_evict(victim)
                    if unused and victim in unused:
                        unused.remove(victim)
                        self._stats.wasted_prefetches += 1
                    if self.on_evict is not None:
                        self.on_evict(victim)
                resident.add(key)
                policy.on_insert(key)
                inserted.append(key)
        finally:
            if demand:
                self._stats.misses += len(inserted)
            elif inserted:
                self._stats.prefetch_inserts += len(inserted)
                unused.update(inserted)
        return inserted

    def _victim_sparing(self, candidates: Candidates, busy: Sequence[Key]) -> Key | None:
        """The policy's victim with the `busy` keys pinned while it chooses."""
        pins = self._pins
        for key in busy:
            pins[key] = pins.get(key, 0) + 1
        try:
            return self.policy.victim(candidates)
        finally:
            self._release(busy)

    def _fail(self, key: Key, keys: Sequence[Key]) -> NoReturn:
        """No room for a demanded key: the keys of the call before it are used, then raise."""
        self._use(keys[: keys.index(key)])
        where = f"layer {key[0]}" if self.per_layer else "the cache"
        raise CacheFullError(
            f"cannot insert {key}: all {self.capacity} slots of {where} are pinned or in use "
            "by the same call; raise the capacity or unpin experts sooner"
        )

    def _release(self, keys: Iterable[Key]) -> None:
        pins = self._pins
        for key in keys:
            count = pins[key] - 1
            if count:
                pins[key] = count
            else:
                del pins[key]
