"""Eviction policies: each one is its ordering rule over a bookkeeping base (see cache.policy).

Registry by name: `POLICIES` and `make_policy(name, **kwargs)`.
"""

from __future__ import annotations

import heapq
from collections.abc import Container, Mapping, Sequence
from itertools import chain
from operator import itemgetter, mul

import numpy as np

from cache.errors import PolicyError, UnknownPolicyError
from cache.policy import Candidates, EvictionPolicy, Key, OrderedPolicy, RankedPolicy

_TICK_MASK = (1 << 48) - 1  # LFU: room for 2.8e14 ticks below the use count


class FIFO(OrderedPolicy):
    """First in, first out (SiDA's rule when the budget is full): uses do not reorder."""

    def on_access_many(self, keys: Sequence[Key]) -> None:
        pass


class LRU(OrderedPolicy):
    """Least recently used: a use moves the key to the end of its partition's order."""

    def on_access(self, key: Key, score: float | None = None) -> None:
        self._orders[key[0] if self.by_layer else None].move_to_end(key)

    def on_access_many(self, keys: Sequence[Key]) -> None:
        if self.by_layer:
            orders = self._orders
            for key in keys:
                orders[key[0]].move_to_end(key)
        else:
            move_to_end = self._orders[None].move_to_end
            for key in keys:
                move_to_end(key)


class LFU(RankedPolicy):
    """Least frequently used since insertion; ties go to the least recently used.

    Rank = (uses, tick of last use or insertion), packed into one int `uses << 48 | tick` (the
    same order, compared faster). Counts are forgotten on eviction.
    """

    def __init__(self) -> None:
        super().__init__()
        self._tick = 0

    def insert_rank(self, key: Key) -> int:
        self._tick += 1
        return self._tick

    def on_access(self, key: Key, score: float | None = None) -> None:
        self.on_access_many((key,))

    def on_access_many(self, keys: Sequence[Key]) -> None:
        ranks, tick = self._ranks, self._tick
        for key in keys:  # one more use, this tick: the rank rises, no heap work (RankedPolicy)
            tick += 1
            ranks[key] = (ranks[key] | _TICK_MASK) + 1 | tick
        self._tick = tick


class StaticHot(RankedPolicy):
    """Fixed ranks from expert frequencies (counted on a training trace): the least frequent
    resident expert is evicted first, so the hottest experts stay once loaded.

    `frequencies`: {(layer, expert): f} or a [L][E] nested sequence / array. Missing keys rank 0.
    """

    def __init__(self, frequencies: Mapping[Key, float] | Sequence[Sequence[float]]) -> None:
        super().__init__()
        if isinstance(frequencies, Mapping):
            self._freq = {(int(l), int(e)): float(f) for (l, e), f in frequencies.items()}
        else:
            self._freq = {(l, e): float(f) for l, row in enumerate(frequencies) for e, f in enumerate(row)}

    def insert_rank(self, key: Key) -> float:
        return self._freq.get(key, 0.0)

    def on_access_many(self, keys: Sequence[Key]) -> None:
        pass  # ranks are fixed


class Belady(RankedPolicy):
    """The offline optimum (MIN): evict the key whose next use is farthest, never-used first.

    It is given the whole future access sequence, and the cache's accesses must follow it exactly
    (a divergence raises PolicyError). Rank = −(position of next use).
    """

    def __init__(self, future: Sequence[Key]) -> None:
        super().__init__()
        self._future = list(future)
        n = len(self._future)
        ids = np.fromiter(chain.from_iterable(self._future), dtype=np.int64, count=2 * n).reshape(n, 2)
        flat = ids[:, 0] * (int(ids[:, 1].max(initial=0)) + 1) + ids[:, 1]  # one id per key
        if flat.max(initial=0) < 1 << 16:
            flat = flat.astype(np.uint16)  # numpy sorts 16-bit ints stably by radix: O(n)
        order = np.argsort(flat, kind="stable")  # positions grouped by key, ascending
        same = flat[order[1:]] == flat[order[:-1]]
        following = np.full(n, n, dtype=np.int64)
        following[order[:-1][same]] = order[1:][same]
        self._rank_after: list[int] = (-following).tolist()  # rank of the key used at i, after it
        first = order[np.flatnonzero(np.r_[True, ~same])] if n else order
        # a key that is not resident ranks by its next use: its first, until it is evicted
        self._rank_outside: dict[Key, int] = {(int(ids[i, 0]), int(ids[i, 1])): -int(i) for i in first}
        self._never = -n
        self._cursor = 0

    def insert_rank(self, key: Key) -> int:
        return self._rank_outside.get(key, self._never)

    def on_evict(self, key: Key) -> None:
        self._rank_outside[key] = self._ranks[key]  # unused until it is back: the rank holds
        super().on_evict(key)

    def on_access(self, key: Key, score: float | None = None) -> None:
        self.on_access_many([key])

    def on_access_many(self, keys: Sequence[Key]) -> None:
        start = self._cursor
        end = start + len(keys)
        if self._future[start:end] != keys:  # a tuple, numpy ints, or a divergence
            self._check(keys)
        self._lower_ranks(keys, self._rank_after[start:end])  # the next use is later
        self._cursor = end

    def _check(self, keys: Sequence[Key]) -> None:
        """Raise PolicyError at the first key off the sequence (the keys before it are used)."""
        future, start = self._future, self._cursor
        for i, key in enumerate(keys, start):
            if i >= len(future) or future[i] != key and tuple(map(int, future[i])) != key:
                expected = future[i] if i < len(future) else "the end of the sequence"
                self._lower_ranks(keys[: i - start], self._rank_after[start:i])
                self._cursor = i
                raise PolicyError(
                    f"access #{i} is {key} but Belady's future sequence has {expected}; "
                    "build it from the same replay (Replay.future()) that drives the cache"
                )


_RESCALE_BELOW = 1e-120
_SCORE = itemgetter(1)
_INF = float("inf")


class MRS(EvictionPolicy):
    """HybriMoE's Minus Recent Score: per layer S ← α·TopP(s) + (1−α)·S; evict the lowest S.

    TopP keeps the p largest step scores (p = 2·top_k by default) and zeroes the rest. Scores are
    kept for every expert, resident or not. Stored as u = S / scale[layer]: a step multiplies the
    layer's scale by (1−α) instead of decaying all E scores, so a step costs O(p) and the order
    within a layer stays exact. Ties go to the lower expert id.

    Bookkeeping, per layer: u by expert, the resident experts, and a lazy min-heap of
    (u, expert) whose top is kept valid (resident, at its current u) after every change, so a
    layer's lowest key is its heap top. Under a global budget the victim compares real S over
    the layers' tops: one C-level pass over [L] lists.
    """

    uses_scores = True
    by_layer = True  # u is scaled per layer: one heap per layer under either budget

    def __init__(self, alpha: float = 0.5, p: int | None = None, top_k: int | None = None) -> None:
        super().__init__()
        if not 0.0 < alpha < 1.0:
            raise ValueError(f"MRS needs 0 < alpha < 1, got {alpha}")
        if p is None:
            if top_k is None:
                raise ValueError("MRS needs p or top_k (p defaults to 2 * top_k)")
            p = 2 * top_k
        if p < 1:
            raise ValueError(f"MRS needs p >= 1, got {p}")
        self.alpha = alpha
        self.p = p
        self.scores_used = p
        self._decay = 1.0 - alpha
        self._u: list[list[float]] = []  # [layer][expert] u, grown as experts appear
        self._scale: list[float] = []  # [layer]
        self._resident: list[set[int]] = []  # [layer] resident experts
        self._heaps: list[list[tuple[float, int]]] = []  # [layer] lazy min-heap of (u, expert)
        self._tops: list[float] = []  # [layer] u of the heap top, inf when the layer holds none

    def _add_layers(self, layer: int) -> None:
        for _ in range(len(self._u), layer + 1):
            self._u.append([])
            self._scale.append(1.0)
            self._resident.append(set())
            self._heaps.append([])
            self._tops.append(_INF)

    def score(self, key: Key) -> float:
        """S of a key, resident or not."""
        layer, expert = key
        if layer >= len(self._u):
            return 0.0
        u = self._u[layer]
        return (u[expert] if expert < len(u) else 0.0) * self._scale[layer]

    def on_step(self, layer: int, scores: Mapping[int, float] | Sequence[float]) -> None:
        items = scores.items() if isinstance(scores, (dict, Mapping)) else enumerate(scores)
        if len(scores) > self.p:
            items = sorted(items, key=_SCORE, reverse=True)[: self.p]
        try:
            scale = self._scale[layer] * self._decay
        except IndexError:
            self._add_layers(layer)
            scale = self._decay
        if scale < _RESCALE_BELOW:
            self._rescale(layer, scale)
            scale = 1.0
        self._scale[layer] = scale
        gain = self.alpha / scale
        u = self._u[layer]
        for expert, s in items:
            try:
                u[expert] += gain * s
            except IndexError:
                u.extend([0.0] * (expert + 1 - len(u)))
                u[expert] += gain * s
            if s < 0.0 and expert in self._resident[layer]:  # a falling u needs a new entry
                heapq.heappush(self._heaps[layer], (u[expert], expert))
        heap = self._heaps[layer]
        if heap and u[heap[0][1]] != heap[0][0]:
            self._fix_top(layer)

    def on_insert(self, key: Key) -> None:
        layer, expert = key
        if layer >= len(self._u):
            self._add_layers(layer)
        u = self._u[layer]
        try:
            value = u[expert]
        except IndexError:
            u.extend([0.0] * (expert + 1 - len(u)))
            value = 0.0
        resident, heap = self._resident[layer], self._heaps[layer]
        resident.add(expert)
        heapq.heappush(heap, (value, expert))
        if len(heap) > 2 * len(resident) + 64:
            self._rebuild(layer)
        self._tops[layer] = heap[0][0]

    def on_evict(self, key: Key) -> None:
        layer, expert = key
        self._resident[layer].remove(expert)
        heap = self._heaps[layer]
        if heap[0][1] == expert:  # the usual case: the victim was the top
            heapq.heappop(heap)
            if heap and (heap[0][1] not in self._resident[layer] or self._u[layer][heap[0][1]] != heap[0][0]):
                self._fix_top(layer)
            else:
                self._tops[layer] = heap[0][0] if heap else _INF

    def on_access_many(self, keys: Sequence[Key]) -> None:
        pass  # uses do not move S: only router scores do

    def victim(self, candidates: Candidates) -> Key | None:
        pinned = candidates.pinned
        if candidates.partition is not None:
            layer = candidates.partition
            best = self._best(layer, pinned) if layer < len(self._u) else None
            return None if best is None else (layer, best)
        heaps, scale = self._heaps, self._scale
        scaled = list(map(mul, self._tops, scale))  # each layer's lowest real S (pins aside)
        exact: dict[int, int] = {}  # layers whose entry in `scaled` skips their pinned keys
        while scaled:
            lowest = min(scaled)
            if lowest == _INF:
                return None
            layer = scaled.index(lowest)  # ties: the lower layer, as (S, key) order has it
            if layer in exact:
                return layer, exact[layer]
            expert = heaps[layer][0][1]
            if (layer, expert) not in pinned:
                return layer, expert
            best = self._best(layer, pinned)
            if best is None:
                scaled[layer] = _INF
            else:
                exact[layer] = best
                scaled[layer] = self._u[layer][best] * scale[layer]
        return None

    def _best(self, layer: int, pinned: Container[Key]) -> int | None:
        """The evictable expert of lowest u in a layer (heap top is valid), or None."""
        heap = self._heaps[layer]
        if not heap:
            return None
        expert = heap[0][1]
        if (layer, expert) not in pinned:
            return expert
        u, resident = self._u[layer], self._resident[layer]
        skipped = []
        try:
            while heap:
                stored, expert = heap[0]
                if expert not in resident or u[expert] < stored:
                    heapq.heappop(heap)  # evicted, or a lower entry of the expert exists
                elif u[expert] > stored:
                    heapq.heapreplace(heap, (u[expert], expert))  # u rose since: move it down
                elif (layer, expert) in pinned:
                    skipped.append(heapq.heappop(heap))
                else:
                    return expert
            return None
        finally:
            for entry in skipped:
                heapq.heappush(heap, entry)

    def _fix_top(self, layer: int) -> None:
        """Drop or refresh stale entries until the heap top is a resident expert at its u."""
        heap, u, resident = self._heaps[layer], self._u[layer], self._resident[layer]
        while heap:
            stored, expert = heap[0]
            if expert not in resident or u[expert] < stored:
                heapq.heappop(heap)
            elif u[expert] > stored:
                heapq.heapreplace(heap, (u[expert], expert))
            else:
                break
        self._tops[layer] = heap[0][0] if heap else _INF

    def _rebuild(self, layer: int) -> None:
        u = self._u[layer]
        heap = [(u[expert], expert) for expert in self._resident[layer]]
        heapq.heapify(heap)
        self._heaps[layer] = heap
        self._tops[layer] = heap[0][0] if heap else _INF

    def _rescale(self, layer: int, factor: float) -> None:
        """Fold `factor` into the layer's stored u (before it underflows) and rebuild its heap."""
        self._u[layer] = [value * factor for value in self._u[layer]]
        self._rebuild(layer)


POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LRU,
    "lfu": LFU,
    "fifo": FIFO,
    "mrs": MRS,
    "belady": Belady,
    "static": StaticHot,
}


def make_policy(name: str, **kwargs: object) -> EvictionPolicy:
    """A new policy object by registry name; kwargs go to its constructor."""
    try:
        cls = POLICIES[name.lower()]
    except KeyError:
        raise UnknownPolicyError(
            f"unknown cache policy {name!r}; known policies: {', '.join(POLICIES)}"
        ) from None
    return cls(**kwargs)
