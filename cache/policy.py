"""The eviction-policy interface and the two bookkeeping bases every policy builds on.

A policy object serves one cache. The cache reports each access, insertion and eviction, and asks
for a victim among the evictable keys of one partition: the whole cache under a global budget, one
layer under a per-layer budget. As in `cachetools`, a base class owns the bookkeeping and a policy
owns only its ordering rule:

- `OrderedPolicy` keeps an OrderedDict per partition; the victim is the first evictable key in it.
  FIFO leaves the order alone, LRU moves a key to the end when it is used.
- `RankedPolicy` keeps a rank per key and a lazy min-heap per partition (stale entries are fixed
  or dropped when they surface); the victim is the evictable key of lowest rank, ties broken by
  key. LFU, Belady and static-hot are ranks. MRS keeps its own per-layer heaps (its scores are
  scaled per layer; see `cache.policies.MRS`).

Victims cost O(1) (ordered) or O(log n) amortised (ranked), plus one step per pinned key skipped;
MRS under a global budget compares the lowest key of each layer, O(L) in one C-level pass.

The simulator replays millions of accesses through these objects, so the hot methods
(`on_access_many`, `victim`, `on_insert`, `on_evict`) bind locals and avoid per-access objects;
`on_access_many` is what the cache calls after inserting a layer-step's missing keys (a demand
replay joins the uses of a stretch without insertions into one call).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, defaultdict
from collections.abc import Container, Iterable, Mapping, Sequence
from typing import Any, ClassVar

from cache.errors import PolicyError

Key = tuple[int, int]
"""(layer, expert)."""

Partition = int | None
"""A layer under a per-layer budget, None under a global one."""

_GONE = object()


class Candidates:
    """The evictable keys of one partition: those resident there that are not pinned.

    A policy keeps its own order over the resident keys it was told about, so it only needs a
    membership test to skip pinned ones; the cache hands out one such view per partition.
    """

    __slots__ = ("partition", "pinned")

    def __init__(self, partition: Partition, pinned: Container[Key]):
        self.partition = partition
        self.pinned = pinned  # policies on a hot path may test `key not in candidates.pinned`

    def __contains__(self, key: object) -> bool:
        return key not in self.pinned


class EvictionPolicy:
    """Interface of every policy. Router scores reach it through `on_step` (MRS uses them)."""

    uses_scores: ClassVar[bool] = False
    """True if the policy needs `on_step` router scores to make sense."""

    scores_used: int | None = None
    """How many of a step's highest scores the policy reads (None: all). A replay may keep
    only that many per step and give the same result."""

    by_layer: bool = False
    """Whether the bookkeeping is split by layer: set from the cache's budget by `attach`."""

    def __init__(self) -> None:
        self._attached = False

    def attach(self, per_layer: bool) -> None:
        """Called once by the cache that owns this policy; a policy holds that cache's state."""
        if self._attached:
            raise PolicyError(
                f"this {type(self).__name__} object already serves a cache; "
                "make one policy object per cache (make_policy(name, ...))"
            )
        self._attached = True
        self.by_layer = per_layer or self.by_layer

    def on_access(self, key: Key, score: float | None = None) -> None:
        """A resident key was used (after `on_insert` when the access was a miss)."""

    def on_access_many(self, keys: Sequence[Key]) -> None:
        """Resident keys used in this order (one layer-step's experts); the same as `on_access`
        each. The cache inserts a call's missing keys (pinned) before it reports the uses."""
        on_access = self.on_access
        for key in keys:
            on_access(key, None)

    def on_insert(self, key: Key) -> None:
        raise NotImplementedError

    def on_evict(self, key: Key) -> None:
        raise NotImplementedError

    def victim(self, candidates: Candidates) -> Key | None:
        """The key to evict from `candidates.partition`, or None if every key there is pinned."""
        raise NotImplementedError

    def on_step(self, layer: int, scores: Mapping[int, float] | Sequence[float]) -> None:
        """Router scores of one layer-step: expert -> score, or a dense vector over experts."""


class OrderedPolicy(EvictionPolicy):
    """Keys in one OrderedDict per partition; the victim is the first evictable key."""

    def __init__(self) -> None:
        super().__init__()
        self._orders: defaultdict[Partition, OrderedDict[Key, None]] = defaultdict(OrderedDict)

    def on_insert(self, key: Key) -> None:
        self._orders[key[0] if self.by_layer else None][key] = None

    def on_evict(self, key: Key) -> None:
        del self._orders[key[0] if self.by_layer else None][key]

    def victim(self, candidates: Candidates) -> Key | None:
        pinned = candidates.pinned
        for key in self._orders[candidates.partition]:
            if key not in pinned:
                return key
        return None


class RankedPolicy(EvictionPolicy):
    """A rank per resident key, a lazy min-heap per partition; the victim has the lowest rank.

    Subclasses give the rank of a newly inserted key (`insert_rank`). A rank that rises (a use)
    is written to `_ranks[key]` alone; ranks that fall go through `_lower_ranks`, which pushes
    an entry each. Invariant: every resident key has a heap entry whose rank is at most its
    current rank. When an entry reaches the top: an evicted key's entry, or one above the
    current rank, is dropped; one below it is re-pushed at the current rank; one equal to it is
    the minimum. A heap is compacted when its stale entries outnumber the live ones three to one.
    """

    def __init__(self) -> None:
        super().__init__()
        self._ranks: dict[Key, Any] = {}
        self._heaps: defaultdict[Partition, list[tuple[Any, Key]]] = defaultdict(list)
        self._live: defaultdict[Partition, int] = defaultdict(int)

    def insert_rank(self, key: Key) -> Any:
        raise NotImplementedError

    def _lower_ranks(self, keys: Sequence[Key], ranks: Iterable[Any]) -> None:
        """Give resident `keys` the (lower or equal) `ranks`, in order."""
        current, push, heaps = self._ranks, heapq.heappush, self._heaps
        if self.by_layer:
            for key, rank in zip(keys, ranks):
                current[key] = rank
                push(heaps[key[0]], (rank, key))
            parts: Iterable[Partition] = {key[0] for key in keys}
        else:
            heap = heaps[None]
            for key, rank in zip(keys, ranks):
                current[key] = rank
                push(heap, (rank, key))
            parts = (None,)
        live = self._live
        for part in parts:
            if len(heaps[part]) > 4 * live[part] + 64:
                self._compact(part)

    def _compact(self, part: Partition) -> None:
        """Drop a partition's stale heap entries: one entry per resident key, at its rank."""
        by_layer = self.by_layer
        heap = [(rank, key) for key, rank in self._ranks.items() if not by_layer or key[0] == part]
        heapq.heapify(heap)
        self._heaps[part] = heap

    def on_insert(self, key: Key) -> None:
        part = key[0] if self.by_layer else None
        live = self._live[part] = self._live[part] + 1
        rank = self._ranks[key] = self.insert_rank(key)
        heap = self._heaps[part]
        heapq.heappush(heap, (rank, key))
        if len(heap) > 4 * live + 64:
            self._compact(part)

    def on_evict(self, key: Key) -> None:
        del self._ranks[key]
        self._live[key[0] if self.by_layer else None] -= 1

    def victim(self, candidates: Candidates) -> Key | None:
        """The evictable key of lowest rank in the partition (ties: the lower key), or None."""
        heap = self._heaps.get(candidates.partition)
        if not heap:
            return None
        ranks, pinned = self._ranks, candidates.pinned
        skipped = []
        try:
            while heap:
                stored, key = heap[0]
                current = ranks.get(key, _GONE)
                if current is _GONE or stored > current:
                    heapq.heappop(heap)  # evicted, or a lower entry of the key exists
                elif stored < current:
                    heapq.heapreplace(heap, (current, key))  # rank rose since: move it down
                elif key in pinned:
                    skipped.append(heapq.heappop(heap))
                else:
                    return key
            return None
        finally:
            for entry in skipped:
                heapq.heappush(heap, entry)
