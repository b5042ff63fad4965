"""Trace-driven cache simulator: replay router traces through an ExpertCache in decode order.

Decode order: sequences are grouped `batch_size` at a time (in trace order) and step together,
token by token; a sequence that ends drops out of its batch. Each token-step runs the layers in
order, and a layer's access set is the union of the batch's top-k experts there. Prefill is not
modelled apart: every trace row is one decode step of its sequence.

Prefetching (when the replay holds predicted scores): the predicted top experts of a layer, the
union over the batch, are prefetched `horizon` layers ahead: at the start of a token-step for
layers 0..horizon-1, and while layer l runs for layer l+horizon (horizon None: all layers at the
token's start). A prefetch takes its slot when issued; the link then moves `transfer_per_step`
queued experts during each layer's compute (None: transfers are instant). Within a layer-step:
router scores reach the policy, the layer's experts are accessed and pinned, prefetches are issued
and transferred, the experts are released.

A stall is an access whose expert was not ready when its layer started: a miss, or a hit on a
prefetched slot whose transfer had not finished (`late_prefetches`); a late transfer is finished
on demand during the stall. Demand loads happen in stall time and do not use the prefetch link.
"""

from __future__ import annotations

import gc
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import cached_property
from itertools import repeat
from operator import itemgetter

import numpy as np
from tqdm.auto import tqdm

from cache.errors import CapacityError
from cache.expert_cache import ExpertCache
from cache.policy import EvictionPolicy, Key


@dataclass
class Replay:
    """A trace laid out for replay: per token-step, per layer, the keys to access."""

    n_layers: int
    n_experts: int
    top_k: int
    batch_size: int
    steps: list[list[list[Key]]]  # [step][layer] -> keys accessed (union over the batch)
    scores: list[list[dict[int, float]]] | None = None  # [step][layer] -> expert -> router score
    predicted: list[list[list[Key]]] | None = None  # [step][layer] -> keys to prefetch, best first
    score_top: int | None = None  # scores keep only each step's score_top highest (None: all)

    @cached_property
    def n_accesses(self) -> int:
        return sum(len(keys) for step in self.steps for keys in step)

    @cached_property
    def max_layer_keys(self) -> int:
        """The most keys one layer-step accesses: the least capacity that can serve the replay."""
        return max((len(keys) for step in self.steps for keys in step), default=0)

    def future(self) -> list[Key]:
        """Every access in replay order: what Belady is given."""
        return [key for step in self.steps for keys in step for key in keys]

    @classmethod
    def build(
        cls,
        topk_ids: np.ndarray,
        seq_id: np.ndarray,
        batch_size: int = 1,
        topt_ids: np.ndarray | None = None,
        topt_logits: np.ndarray | None = None,
        predicted_scores: np.ndarray | None = None,
        prefetch_k: int | None = None,
        score_top: int | None = None,
        n_experts: int | None = None,
    ) -> "Replay":
        """`topk_ids` [N, L, k] and `seq_id` [N] in trace order (a sequence's rows contiguous,
        in position order). `topt_ids`/`topt_logits` [N, L, T]: router scores for policies that
        use them (softmax over the top-T, summed over the batch); `score_top` keeps only each
        layer-step's highest few, which is exact for a policy whose `scores_used` <= score_top
        and makes the replay faster. `predicted_scores` [N, L, E]: each row's top `prefetch_k`
        (default k) experts per layer are prefetched."""
        topk_ids = np.asarray(topk_ids)
        if topk_ids.ndim != 3:
            raise ValueError(f"topk_ids must be [N, L, k], got shape {topk_ids.shape}")
        n, n_layers, top_k = topk_ids.shape
        if n and topk_ids.min() < 0:
            raise ValueError("topk_ids holds negative expert ids: drop padding rows before replaying")
        if n_experts is None:
            highs = [topk_ids.max(initial=-1)]
            if topt_ids is not None:
                highs.append(np.asarray(topt_ids).max(initial=-1))
            n_experts = int(max(highs)) + 1
            if predicted_scores is not None:
                n_experts = max(n_experts, np.asarray(predicted_scores).shape[2])
        table = [[(layer, e) for e in range(n_experts)] for layer in range(n_layers)]
        if len(seq_id) != n:
            raise ValueError(f"seq_id has {len(seq_id)} rows, topk_ids {n}")
        if (topt_ids is None) != (topt_logits is None):
            raise ValueError("give both topt_ids and topt_logits, or neither")
        with _gc_paused():  # millions of small long-lived lists: collections would only slow it
            step_rows = batch_steps(np.asarray(seq_id), batch_size)
            steps = _union_keys(topk_ids.tolist(), step_rows, table)
            scores = _router_scores(topt_ids, topt_logits, step_rows, score_top)
            predicted = _predicted_keys(predicted_scores, top_k if prefetch_k is None else prefetch_k, step_rows, table)
        return cls(n_layers, n_experts, top_k, batch_size, steps, scores, predicted, score_top)


@contextmanager
def _gc_paused() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _router_scores(
    topt_ids: np.ndarray | None, topt_logits: np.ndarray | None, step_rows: list[list[int]], score_top: int | None
) -> list[list[dict[int, float]]] | None:
    """Softmax over each row's top-T logits, summed per step and layer over the batch."""
    if topt_ids is None:
        return None
    logits = np.asarray(topt_logits, dtype=np.float64)
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    ids = np.asarray(topt_ids)
    if score_top is not None and all(len(rows) == 1 for rows in step_rows):  # a row's top = the step's
        order = np.argsort(-probs, axis=-1, kind="stable")[..., :score_top]
        ids, probs = np.take_along_axis(ids, order, -1), np.take_along_axis(probs, order, -1)
        score_top = None  # done
    return _summed_scores(ids.tolist(), probs.tolist(), step_rows, score_top)


def _predicted_keys(
    predicted_scores: np.ndarray | None, m: int, step_rows: list[list[int]], table: list[list[Key]]
) -> list[list[list[Key]]] | None:
    """Each row's top-m predicted experts per layer, best first, united over the batch."""
    if predicted_scores is None:
        return None
    pred = np.asarray(predicted_scores)
    if not 1 <= m <= pred.shape[-1]:
        raise ValueError(f"prefetch_k must be in 1..{pred.shape[-1]} (the predicted experts), got {m}")
    top = np.argpartition(-pred, m - 1, axis=-1)[..., :m]
    order = np.argsort(-np.take_along_axis(pred, top, axis=-1), axis=-1, kind="stable")
    return _union_keys(np.take_along_axis(top, order, axis=-1).tolist(), step_rows, table)


def batch_steps(seq_id: np.ndarray, batch_size: int) -> list[list[int]]:
    """Row indices of each decode step: sequences grouped `batch_size` at a time step together;
    a finished sequence drops out of its batch."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    n = len(seq_id)
    if n == 0:
        return []
    starts = np.flatnonzero(np.r_[True, seq_id[1:] != seq_id[:-1]])
    if len(np.unique(seq_id[starts])) != len(starts):
        raise ValueError("rows of one sequence must be contiguous in the trace (seq_id repeats later)")
    if batch_size == 1:
        return [[row] for row in range(n)]
    lengths = np.diff(np.r_[starts, n])
    steps: list[list[int]] = []
    for g in range(0, len(starts), batch_size):
        group_starts, group_lengths = starts[g : g + batch_size], lengths[g : g + batch_size]
        for t in range(int(group_lengths.max())):
            steps.append((group_starts[group_lengths > t] + t).tolist())
    return steps


def _union_keys(ids: list, step_rows: list[list[int]], table: list[list[Key]]) -> list[list[list[Key]]]:
    """Per step, per layer: the keys of the rows' experts, first appearance first (rank-major)."""
    if all(len(rows) == 1 for rows in step_rows):
        return [[[keys[e] for e in row_ids] for keys, row_ids in zip(table, ids[rows[0]])] for rows in step_rows]
    out = []
    for rows in step_rows:
        per_row = [ids[r] for r in rows]
        out.append(
            [
                [keys[e] for e in dict.fromkeys(e for rank in zip(*layer_ids) for e in rank)]
                for keys, layer_ids in zip(table, zip(*per_row))
            ]
        )
    return out


def _summed_scores(
    ids: list, probs: list, step_rows: list[list[int]], score_top: int | None
) -> list[list[dict[int, float]]]:
    """Per step, per layer: expert -> router probability summed over the step's rows (the
    `score_top` highest if given)."""
    out = []
    for rows in step_rows:
        if len(rows) == 1 and score_top is None:
            out.append([dict(zip(i, p)) for i, p in zip(ids[rows[0]], probs[rows[0]])])
            continue
        layers = []
        for layer in range(len(ids[rows[0]])):
            summed: dict[int, float] = {}
            for r in rows:
                for e, p in zip(ids[r][layer], probs[r][layer]):
                    summed[e] = summed.get(e, 0.0) + p
            if score_top is not None and len(summed) > score_top:
                summed = dict(sorted(summed.items(), key=itemgetter(1), reverse=True)[:score_top])
            layers.append(summed)
        out.append(layers)
    return out


@dataclass
class SimResult:
    policy: str
    capacity: int
    per_layer: bool
    batch_size: int
    horizon: int | None
    transfer_per_step: int | None
    accesses: int
    hits: int
    misses: int
    stalls: int
    late_prefetches: int
    prefetch_inserts: int
    prefetch_hits: int
    wasted_prefetches: int
    evictions: int
    seconds: float

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def stall_rate(self) -> float:
        return self.stalls / self.accesses if self.accesses else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate, "stall_rate": self.stall_rate}


def simulate(
    replay: Replay,
    capacity: int,
    policy: EvictionPolicy,
    per_layer: bool = False,
    horizon: int | None = None,
    transfer_per_step: int | None = None,
    progress: bool = False,
) -> SimResult:
    """Replay through a fresh ExpertCache(capacity, policy). Prefetches when the replay holds
    predictions. `policy` must be a new object (a policy serves one cache). Policies with
    `uses_scores` get the replay's router scores before each layer-step."""
    if replay.max_layer_keys > capacity:
        where = "per layer" if per_layer else "in all"
        raise CapacityError(
            f"capacity {capacity} {where} cannot hold one layer-step's experts at batch size "
            f"{replay.batch_size}; the minimum is {replay.max_layer_keys} slots {where}"
        )
    name = type(policy).__name__
    if policy.uses_scores and replay.scores is None:
        raise ValueError(f"{name} needs router scores: build the Replay with topt_ids and topt_logits")
    if policy.uses_scores and replay.score_top is not None:
        if policy.scores_used is None or policy.scores_used > replay.score_top:
            raise ValueError(
                f"{name} reads {policy.scores_used or 'all'} scores per step but the replay kept "
                f"{replay.score_top}; build it with score_top >= {policy.scores_used} or None"
            )
    if horizon is not None and horizon < 1:
        raise ValueError(f"horizon must be >= 1 or None, got {horizon}")
    if transfer_per_step is not None and transfer_per_step < 0:
        raise ValueError(f"transfer_per_step must be >= 0 or None, got {transfer_per_step}")

    pending: OrderedDict[Key, None] = OrderedDict()  # prefetched, slot taken, not yet transferred
    limited = replay.predicted is not None and transfer_per_step is not None
    cache = ExpertCache(
        capacity,
        policy,
        per_layer=per_layer,
        on_evict=(lambda key: pending.pop(key, None)) if limited else None,
    )
    steps = tqdm(replay.steps, desc=f"simulate {name}", unit="step", leave=False) if progress else replay.steps
    started = time.perf_counter()
    late = 0
    if replay.predicted is None:
        _replay_demand(steps, replay, cache)
    else:
        ahead = replay.n_layers if horizon is None else min(horizon, replay.n_layers)
        late = _replay_prefetch(steps, replay, cache, ahead, transfer_per_step, pending)
    seconds = time.perf_counter() - started
    s = cache.stats
    return SimResult(
        policy=name,
        capacity=capacity,
        per_layer=per_layer,
        batch_size=replay.batch_size,
        horizon=horizon,
        transfer_per_step=transfer_per_step,
        accesses=s.accesses,
        hits=s.hits,
        misses=s.misses,
        stalls=s.misses + late,
        late_prefetches=late,
        prefetch_inserts=s.prefetch_inserts,
        prefetch_hits=s.prefetch_hits,
        wasted_prefetches=s.wasted_prefetches,
        evictions=s.evictions,
        seconds=seconds,
    )


def _replay_demand(steps: Iterable[list[list[Key]]], replay: Replay, cache: ExpertCache) -> None:
    """No prefetching: every stall is a miss."""
    use_scores = replay.scores is not None and cache.policy.uses_scores
    cache.access_steps(steps, replay.scores if use_scores else None)


def _replay_prefetch(
    steps: Iterable[list[list[Key]]],
    replay: Replay,
    cache: ExpertCache,
    ahead: int,
    bandwidth: int | None,
    pending: OrderedDict[Key, None],
) -> int:
    """Demand accesses plus prefetches `ahead` layers early over a link of `bandwidth`; returns
    the number of late prefetches."""
    access_and_prefetch, prefetch_many, on_step = cache.access_and_prefetch, cache.prefetch_many, cache.on_step
    n_layers = replay.n_layers
    use_scores = replay.scores is not None and cache.policy.uses_scores
    late = 0

    for step, predicted, step_scores in zip(steps, replay.predicted, replay.scores if use_scores else repeat(None)):
        for layer in range(ahead):
            inserted = prefetch_many(predicted[layer])
            if bandwidth is not None and inserted:
                pending.update(dict.fromkeys(inserted))
        for layer, keys in enumerate(step):
            if step_scores is not None:
                on_step(layer, step_scores[layer])
            if pending and not pending.keys().isdisjoint(keys):
                for key in keys:
                    if key in pending:
                        del pending[key]  # still on the link: finished on demand, a stall
                        late += 1
            # access (pinned), issue the prefetch `ahead` layers on, release
            _, inserted = access_and_prefetch(keys, predicted[layer + ahead] if layer + ahead < n_layers else ())
            if bandwidth is not None:
                if inserted:
                    pending.update(dict.fromkeys(inserted))
                if len(pending) <= bandwidth:  # the link moves while the layer computes
                    pending.clear()
                else:
                    for _ in range(bandwidth):
                        pending.popitem(last=False)
    return late


def expert_frequencies(topk_ids: np.ndarray, n_experts: int) -> np.ndarray:
    """[L, E] fraction of tokens routed to each expert (input of the static-hot policy)."""
    topk_ids = np.asarray(topk_ids)
    n, n_layers, _ = topk_ids.shape
    flat = (topk_ids + np.arange(n_layers)[None, :, None] * n_experts).ravel()
    counts = np.bincount(flat, minlength=n_layers * n_experts).reshape(n_layers, n_experts)
    return counts / max(n, 1)
