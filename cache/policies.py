"""Eviction policies: each one is its ordering rule over a bookkeeping base (see cache.policy).

Registry by name: `POLICIES` and `make_policy(name, **kwargs)`.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from collections.abc import Mapping, Sequence
from operator import itemgetter

from cache.errors import PolicyError, UnknownPolicyError
from cache.policy import Candidates, EvictionPolicy, Key, OrderedPolicy, RankedPolicy


class FIFO(OrderedPolicy):
    """First in, first out (SiDA's rule when the budget is full): uses do not reorder."""

    def on_access_many(self, keys: Sequence[Key]) -> None:
        pass


class LRU(OrderedPolicy):
    """Least recently used: a use moves the key to the end of its partition's order."""

    def on_access(self, key: Key, score: float | None = None) -> None:
        self._orders[key[0] if self.by_layer else None].move_to_end(key)

    def on_access_many(self, keys: Sequence[Key]) -> None:
        orders, by_layer = self._orders, self.by_layer
        for key in keys:
            orders[key[0] if by_layer else None].move_to_end(key)


class LFU(RankedPolicy):
    """Least frequently used since insertion; ties go to the least recently used.

    Rank = (uses, tick of last use or insertion). Counts are forgotten on eviction.
    """

    def __init__(self) -> None:
        super().__init__()
        self._tick = 0

    def insert_rank(self, key: Key) -> tuple[int, int]:
        self._tick += 1
        return 0, self._tick

    def on_access(self, key: Key, score: float | None = None) -> None:
        self._tick += 1
        self.set_rank(key, (self.rank(key)[0] + 1, self._tick))


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


class Belady(RankedPolicy):
    """The offline optimum (MIN): evict the key whose next use is farthest, never-used first.

    It is given the whole future access sequence, and the cache's accesses must follow it exactly
    (a divergence raises PolicyError). Rank = −(position of next use).
    """

    def __init__(self, future: Sequence[Key]) -> None:
        super().__init__()
        self._future = [(int(l), int(e)) for l, e in future]
        n = len(self._future)
        self._positions: dict[Key, list[int]] = defaultdict(list)
        for i, key in enumerate(self._future):
            self._positions[key].append(i)
        self._next = [n] * n
        for positions in self._positions.values():
            for here, later in zip(positions, positions[1:]):
                self._next[here] = later
        self._cursor = 0

    def insert_rank(self, key: Key) -> int:
        positions = self._positions.get(key, ())
        i = bisect_left(positions, self._cursor)
        return -(positions[i] if i < len(positions) else len(self._future))

    def on_access(self, key: Key, score: float | None = None) -> None:
        i = self._cursor
        if i >= len(self._future) or self._future[i] != key:
            expected = self._future[i] if i < len(self._future) else "the end of the sequence"
            raise PolicyError(
                f"access #{i} is {key} but Belady's future sequence has {expected}; "
                "build it from the same replay (Replay.future()) that drives the cache"
            )
        self._cursor = i + 1
        self.set_rank(key, -self._next[i])


_RESCALE_BELOW = 1e-120
_SCORE = itemgetter(1)


class MRS(RankedPolicy):
    """HybriMoE's Minus Recent Score: per layer S ← α·TopP(s) + (1−α)·S; evict the lowest S.

    TopP keeps the p largest step scores (p = 2·top_k by default) and zeroes the rest. Scores are
    kept for every expert, resident or not. Stored as u = S / scale[layer]: a step multiplies the
    layer's scale by (1−α) instead of decaying all E scores, so a step costs O(p log n) and the
    heap order within a layer stays exact; under a global budget the victim compares real S over
    the lowest key of each layer. Ties go to the lower expert id.
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
        self._u: defaultdict[int, dict[int, float]] = defaultdict(dict)
        self._scale: defaultdict[int, float] = defaultdict(lambda: 1.0)

    def score(self, key: Key) -> float:
        """S of a key, resident or not."""
        layer, expert = key
        return self._u[layer].get(expert, 0.0) * self._scale[layer]

    def insert_rank(self, key: Key) -> float:
        return self._u[key[0]].get(key[1], 0.0)

    def on_step(self, layer: int, scores: Mapping[int, float] | Sequence[float]) -> None:
        items = scores.items() if isinstance(scores, (dict, Mapping)) else enumerate(scores)
        if len(scores) > self.p:
            items = sorted(items, key=_SCORE, reverse=True)[: self.p]
        scale = self._scale[layer] * (1.0 - self.alpha)
        if scale < _RESCALE_BELOW:
            self._rescale(layer, scale)
            scale = 1.0
        self._scale[layer] = scale
        gain = self.alpha / scale
        u = self._u[layer]
        ranks = self._ranks
        for expert, s in items:
            value = u.get(expert, 0.0) + gain * s
            u[expert] = value
            key = (layer, expert)
            old = ranks.get(key)
            if old is not None:  # resident
                if value >= old:
                    ranks[key] = value  # a rising rank needs no heap push (see RankedPolicy)
                else:
                    self.set_rank(key, value)

    def victim(self, candidates: Candidates) -> Key | None:
        if candidates.partition is not None:
            return super().victim(candidates)
        ranks, pinned, scale = self._ranks, candidates.pinned, self._scale
        best: tuple[float, Key] | None = None
        for layer, heap in self._heaps.items():
            entry = heap[0] if heap else None
            if entry is None or ranks.get(entry[1]) != entry[0] or entry[1] in pinned:
                entry = self.best(layer, candidates)  # the top is stale or pinned: clean up
                if entry is None:
                    continue
            scored = (entry[0] * scale[layer], entry[1])
            if best is None or scored < best:
                best = scored
        return None if best is None else best[1]

    def _rescale(self, layer: int, factor: float) -> None:
        """Fold `factor` into the layer's stored u (before it underflows) and rebuild its heap."""
        u = self._u[layer]
        for expert in u:
            u[expert] *= factor
        self._rebuild(layer, {key: u[key[1]] for key in self.resident_in(layer)})


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
