"""Eviction policies by name: `POLICIES` and `make_policy(name, **kwargs)`. Each class names its
ordering rule (written out in `cache.rules`) and holds what the rule needs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from cache import state
from cache.errors import PolicyError, UnknownPolicyError
from cache.policy import EvictionPolicy, Key


class FIFO(EvictionPolicy):
    """First in, first out (SiDA's rule when the budget is full): uses do not reorder."""

    kind = state.FIFO


class LRU(EvictionPolicy):
    """Least recently used."""

    kind = state.LRU


class LFU(EvictionPolicy):
    """Least frequently used since insertion; ties go to the least recently used. Counts are
    forgotten on eviction."""

    kind = state.LFU


class StaticHot(EvictionPolicy):
    """Fixed ranks from expert frequencies (counted on a training trace): the least frequent
    resident expert is evicted first, so the hottest experts stay once loaded.

    `frequencies`: {(layer, expert): f} or a [L][E] nested sequence / array. Missing keys rank 0.
    """

    kind = state.STATIC

    def __init__(self, frequencies: Mapping[Key, float] | Sequence[Sequence[float]] | np.ndarray) -> None:
        super().__init__()
        if isinstance(frequencies, Mapping):
            self.frequencies = {(int(l), int(e)): float(f) for (l, e), f in frequencies.items()}
        else:
            self.frequencies = {(l, e): float(f) for l, row in enumerate(frequencies) for e, f in enumerate(row)}

    def attach(self, cache) -> None:
        super().attach(cache)
        ids = cache.key_ids(list(self.frequencies))
        cache.state.outside[ids] = list(self.frequencies.values())


class Belady(EvictionPolicy):
    """The offline optimum (MIN): evict the key whose next use is farthest, never-used first.

    It is given the whole future access sequence (keys, or an [M, 2] array of (layer, expert)),
    and the cache's accesses must follow it exactly (a divergence raises PolicyError).
    """

    kind = state.BELADY

    def __init__(self, future: Sequence[Key] | np.ndarray) -> None:
        super().__init__()
        self.future = np.asarray(future, dtype=np.int64).reshape(-1, 2)

    @property
    def default_rank(self) -> float:
        return -float(len(self.future))  # never used: evicted first

    def attach(self, cache) -> None:
        super().attach(cache)
        ids = cache.key_ids(self.future)
        n = len(ids)
        order = np.argsort(ids, kind="stable")  # positions grouped by key, ascending
        same = ids[order[1:]] == ids[order[:-1]]
        following = np.full(n, n, dtype=np.int64)
        following[order[:-1][same]] = order[1:][same]
        first = order[np.flatnonzero(np.r_[True, ~same])] if n else order
        cache.state.outside[ids[first]] = -first.astype(np.float64)  # a key outside ranks by its next use
        cache.state = cache.state.replaced(future=ids, following=following)

    def off_sequence(self, position: int, key: Key) -> PolicyError:
        expected = tuple(self.future[position].tolist()) if position < len(self.future) else "the end of the sequence"
        return PolicyError(
            f"access #{position} is {key} but Belady's future sequence has {expected}; "
            "build it from the same replay (Replay.future()) that drives the cache"
        )


class MRS(EvictionPolicy):
    """HybriMoE's Minus Recent Score: per layer S ← α·TopP(s) + (1−α)·S; evict the lowest S.

    TopP keeps the p largest step scores (p = 2·top_k by default) and zeroes the rest. Scores are
    kept for every expert, resident or not; ties go to the lower key.
    """

    kind = state.MRS
    uses_scores = True
    layer_heaps = True

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

    def score(self, key: Key) -> float:
        """S of a key, resident or not (0 before any router score reached it)."""
        if self.cache is None:
            return 0.0
        (key_id,) = self.cache.key_ids([key])
        st = self.cache.state
        return float(st.rank[key_id] * st.scale[key[0]])


class Learned(EvictionPolicy):
    """Learned eviction: evict the resident expert whose use is predicted least likely soon
    (`ExpertCache.on_forecast`: the predictor's scores for this token's layers and its forecasts
    for the next tokens); experts without a forecast go first, least recently used first.

    As Lykouris & Vassilvitskii's predictive marker, experts used in the current phase are kept
    until every resident expert is (then a new phase starts): with useless forecasts it is a
    randomised marking algorithm, close to LRU, never worse than O(log k)-competitive.
    `LearnedBelady` drops the marks and follows the forecasts alone.
    """

    kind = state.LEARNED
    uses_forecasts = True
    marking = True


class LearnedBelady(Learned):
    """`Learned` without the marks: the forecasts alone decide (Belady's rule on predictions)."""

    marking = False


POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LRU,
    "lfu": LFU,
    "fifo": FIFO,
    "mrs": MRS,
    "belady": Belady,
    "static": StaticHot,
    "learned": Learned,
    "learned-belady": LearnedBelady,
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


# what the serving runtime cannot give a policy, which a replayed trace can
_NEEDS_A_TRACE = {
    "belady": "it needs the future access sequence (the offline bound); compare it with `prescient compare-caches`",
    "static": "it needs expert frequencies counted on a trace; compare it with `prescient compare-caches`",
}
SERVING_POLICIES = tuple(name for name in POLICIES if name not in _NEEDS_A_TRACE)


def make_serving_policy(name: str, top_k: int) -> EvictionPolicy:
    """A policy the serving runtime can drive, by registry name, for a model routing `top_k`
    experts per token; a policy that needs a trace is refused with the reason."""
    key = name.lower()
    if key in _NEEDS_A_TRACE:
        raise PolicyError(f"cache policy {name!r} cannot serve: {_NEEDS_A_TRACE[key]}; "
                          f"serving policies: {', '.join(SERVING_POLICIES)}")
    return make_policy(key, **({"top_k": top_k} if key == "mrs" else {}))
