"""ExpertCache: which experts hold a fast-memory slot. It decides; it never copies weights.

The budget is `capacity` slots in all (global) or per layer (`per_layer=True`). A miss inserts
the key, evicting the policy's victim when the partition is full. Pinned keys (experts in use, a
pin count each) are never evicted. One RLock guards everything: the runtime's loader thread
(prefetch) and inference thread (access, pin) share one cache.

`on_evict(key)` is called, under the lock, after each eviction: the runtime frees the slot there,
the simulator cancels the key's transfer. It must not block; it may call back into the cache.

`access_steps` (a whole demand replay) and `access_and_prefetch` (one layer-step with the loader
ahead) are the simulator's bulk forms of the same calls: one lock and no per-call overhead (about
a million LRU accesses per second on one core). Hits and evictions are derived from the other
counters (see `stats`) rather than counted on the hot path.
"""

from __future__ import annotations

from itertools import repeat

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

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
            stats = self._stats
            hit = key in self._resident
            if hit:
                if key in self._unused_prefetches:
                    self._unused_prefetches.discard(key)
                    stats.prefetch_hits += 1
            else:
                self._insert(key, demand=True)
                stats.misses += 1
            stats.accesses += 1
            self.policy.on_access(key, score)
            return hit

    def access_many(self, keys: Sequence[Key], pin: bool = False) -> int:
        """Use `keys` (one layer-step's experts) in order; return the number of misses.

        The keys are pinned for the whole call, so a miss never evicts another of them; with
        `pin=True` they stay pinned afterwards (release with `unpin_many`). Raises CacheFullError,
        leaving pins as they were, if the keys and the pinned keys do not fit in a partition."""
        with self._lock:
            if not self._resident.issuperset(keys):
                return self._access_with_misses(keys, pin)
            # all hits: nothing is inserted, so nothing needs protecting during the call
            if self._unused_prefetches:
                self._count_prefetch_hits(keys)
            self.policy.on_access_many(keys)
            self._stats.accesses += len(keys)
            if pin:
                pins = self._pins
                for key in keys:
                    pins[key] = pins.get(key, 0) + 1
            return 0

    def access_steps(
        self,
        steps: Iterable[Sequence[Sequence[Key]]],
        scores: Iterable[Sequence[Mapping[int, float] | Sequence[float]]] | None = None,
    ) -> int:
        """Decode token-steps in order: for each step, for each layer l, `on_step(l, scores[t][l])`
        (if `scores` is given), then `access_many(steps[t][l])`. The same as those calls one by
        one, under one lock (the simulator's demand replay). Returns the number of misses."""
        with self._lock:
            issuperset = self._resident.issuperset
            on_hits, on_step = self.policy.on_access_many, self.policy.on_step
            with_misses, unused = self._access_with_misses, self._unused_prefetches
            hit_keys = misses = 0
            try:
                for step, step_scores in zip(steps, scores if scores is not None else repeat(None)):
                    for layer, keys in enumerate(step):
                        if step_scores is not None:
                            on_step(layer, step_scores[layer])
                        if issuperset(keys):
                            if unused:
                                self._count_prefetch_hits(keys)
                            on_hits(keys)
                            hit_keys += len(keys)
                        else:
                            misses += with_misses(keys, False)
            finally:
                self._stats.accesses += hit_keys
            return misses

    # -- prefetch path ---------------------------------------------------------------------

    def prefetch(self, key: Key, pin: bool = False) -> bool:
        """Insert `key` ahead of use (no access counted). False if it is already resident or
        its partition is full of pinned keys."""
        return bool(self.prefetch_many((key,), pin))

    def prefetch_many(self, keys: Iterable[Key], pin: bool = False) -> list[Key]:
        """`prefetch` keys in order (best first); return those inserted. A key inserted by the
        call is not evicted by a later one of the same call: what does not fit is skipped.
        With `pin=True` the inserted keys stay pinned (while the loader fills their slots)."""
        with self._lock:
            return self._prefetch_many(keys if isinstance(keys, (list, tuple)) else list(keys), pin)

    def access_and_prefetch(self, keys: Sequence[Key], prefetch_keys: Sequence[Key]) -> tuple[int, list[Key]]:
        """One layer-step with the loader running ahead: `access_many(keys, pin=True)`, then
        `prefetch_many(prefetch_keys)` while `keys` are pinned, then `unpin_many(keys)`; the
        same as those three calls, under one lock. Returns (misses, keys prefetched)."""
        with self._lock:
            resident = self._resident
            if resident.issuperset(keys):  # all hits, as in access_many
                if self._unused_prefetches:
                    self._count_prefetch_hits(keys)
                self.policy.on_access_many(keys)
                self._stats.accesses += len(keys)
                if resident.issuperset(prefetch_keys):
                    return 0, []  # nothing to load: no need to pin `keys` meanwhile
                misses = 0
                pins = self._pins
                for key in keys:
                    pins[key] = pins.get(key, 0) + 1
            else:
                misses = self._access_with_misses(keys, True)
            try:
                return misses, self._prefetch_many(prefetch_keys, False)
            finally:
                self._release(keys)

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

    def _access_with_misses(self, keys: Sequence[Key], pin: bool) -> int:
        """Insert the missing keys (all of `keys` pinned meanwhile), then report the uses."""
        pins = self._pins
        for key in keys:  # a miss must not evict another key of the call
            pins[key] = pins.get(key, 0) + 1
        resident, unused, insert = self._resident, self._unused_prefetches, self._insert
        done = misses = prefetch_hits = 0
        try:
            for key in keys:
                if key not in resident:
                    insert(key, True)
                    misses += 1
                elif unused and key in unused:
                    unused.discard(key)
                    prefetch_hits += 1
                done += 1
        except CacheFullError:
            self._release(keys)
            raise
        finally:
            stats = self._stats
            stats.accesses += done
            stats.misses += misses
            if prefetch_hits:
                stats.prefetch_hits += prefetch_hits
            self.policy.on_access_many(keys[:done] if done < len(keys) else keys)
        if not pin:
            self._release(keys)
        return misses

    def _prefetch_many(self, keys: Sequence[Key], pin: bool) -> list[Key]:
        resident, insert, pins = self._resident, self._insert, self._pins
        if resident.issuperset(keys):
            return []
        inserted: list[Key] = []
        try:
            for key in keys:
                if key not in resident and insert(key, demand=False):
                    inserted.append(key)
                    pins[key] = pins.get(key, 0) + 1
        finally:
            if not pin and inserted:
                self._release(inserted)
        if inserted:
            self._stats.prefetch_inserts += len(inserted)
            self._unused_prefetches.update(inserted)
        return inserted

    def _count_prefetch_hits(self, keys: Sequence[Key]) -> None:
        """Resident `keys` are being used: those prefetched and not used before count once."""
        unused = self._unused_prefetches
        if not unused.isdisjoint(keys):
            used = unused.intersection(keys)
            unused -= used
            self._stats.prefetch_hits += len(used)

    def _release(self, keys: Iterable[Key]) -> None:
        pins = self._pins
        for key in keys:
            count = pins[key] - 1
            if count:
                pins[key] = count
            else:
                del pins[key]

    def _insert(self, key: Key, demand: bool) -> bool:
        """Make room in the key's partition and insert it. On no room: raise if `demand`,
        else return False."""
        if self.n_layers is not None and not 0 <= key[0] < self.n_layers:
            raise CacheError(f"key {key} names layer {key[0]} but the cache has {self.n_layers} layers")
        part = key[0] if self.per_layer else None
        candidates = self._full.get(part)
        if candidates is None:  # a free slot
            fill = self._fill[part] = self._fill.get(part, 0) + 1
            if fill == self.capacity:
                self._full[part] = Candidates(part, self._pins)
        else:  # one out, one in
            victim = self.policy.victim(candidates)
            if victim is None:
                if not demand:
                    return False
                where = f"layer {part}" if self.per_layer else "the cache"
                raise CacheFullError(
                    f"cannot insert {key}: all {self.capacity} slots of {where} are pinned or in use "
                    "by the same call; raise the capacity or unpin experts sooner"
                )
            self._resident.remove(victim)
            self.policy.on_evict(victim)
            if self._unused_prefetches and victim in self._unused_prefetches:
                self._unused_prefetches.remove(victim)
                self._stats.wasted_prefetches += 1
            if self.on_evict is not None:
                self.on_evict(victim)
        self._resident.add(key)
        self.policy.on_insert(key)
        return True
