"""Trace-driven cache simulator: replay router traces through an ExpertCache in decode order.

Decode order: sequences are grouped `batch_size` at a time (in trace order) and step together,
token by token; a sequence that ends drops out of its batch. Each token-step runs the layers in
order, and a layer's access set is the union of the batch's top-k experts there. Prefill is not
modelled apart: every trace row is one decode step of its sequence.

Prefetching (when the replay holds predicted scores): the predicted top experts of a layer, the
union over the batch, are prefetched `layers_ahead` layers early: at the start of a token-step for
layers 0..layers_ahead-1, and while layer l runs for layer l+layers_ahead (layers_ahead None: all layers at the
token's start). A prefetch takes its slot when issued; the link then moves `transfer_per_step`
queued experts during each layer's compute (None: transfers are instant). Within a layer-step:
router scores reach the policy, the layer's experts are accessed and pinned, prefetches are issued
and transferred, the experts are released.

A stall is an access whose expert was not ready when its layer started: a miss, or a hit on a
prefetched slot whose transfer had not finished (`late_prefetches`); a late transfer is finished
on demand during the stall. Demand loads happen in stall time and do not use the prefetch link.

Timed (`timing=LinkTiming(...)`, instead of `transfer_per_step`): the same cache decisions on a
clock. A layer-step starts when the previous one ends. With `expert_pipeline` (the
per-expert overlap of compute and copies, Klotski's order, on by default as in the runtime, `RuntimeOptions.expert_pipeline`) its
experts resident when it starts compute first while its misses are copied, then each miss as its
copy lands, in arrival order, each for `expert_compute_s` / the layer-step's experts, and the rest
of `layer_compute_s` (attention, router: in the runtime they run before the misses are requested)
after them; without it, the layer-step computes `layer_compute_s` once all its experts are in.
The link keeps up to `reads_in_flight` copies in flight, as the runtime's transfer workers do: a
copy starts on the first idle one, and one that starts with n - 1 others in flight takes n
experts' bytes at the rate measured with n in flight (`LinkTiming.copy_s`; with one in flight,
`expert_bytes / link_bytes_per_s`); a copy once started runs to its end. The queue is the
runtime's transfer engine's: demand loads first, in request order, then prefetches, the newest
token-step's first, each step's in issue order (the best first). A prefetch is issued when its
layer-step's compute starts: as it starts when pipelined (the runtime requests them right after
the layer's demand loads), once its experts are in otherwise (those of a token's first
`layers_ahead` layers when the token starts), and cannot start earlier. When a layer-step
starts, its misses are demand loads behind the copies in flight and the demand loads queued
before them, a prefetch still queued for it becomes a demand load, and one in flight is waited
for; stall is the time the layer-step's compute waits for copies (a late prefetch's included).
An evicted key's queued copy is cancelled; a prefetch copied and evicted before any use is
wasted. Reported: simulated seconds, stall seconds, bytes moved and bytes wasted, per generated
token (trace row), and tokens/s (`SimResult.timed`). With `hide_only` (cost-aware prefetch's link
half) a predicted key is prefetched only if, behind the copies in flight and the prefetches
queued, the link moving one per `transfer_s`, its copy ends before its layer-step starts (the
compute of the layer-steps in between, stalls not counted); the others are left to demand loads. Cross-token prefetch (a Replay built with
`next_chances`, timed only): when a layer-step's `layers_ahead` reaches past the token's last layer,
it prefetches the layer it reaches in the next token from the forecast made at this token.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from functools import cached_property

import numpy as np

from cache.errors import CapacityError, ReplayInputError
from cache.expert_cache import ExpertCache, Forecasts
from cache.policy import EvictionPolicy
from cache.replay import DEMAND, NOW, PREFETCH, STALL, WASTED_LOADS
from cache.timing import LinkTiming, TimedStats, TimingError


@dataclass
class Replay:
    """A trace laid out for replay as flat arrays over layer-steps j = t·n_layers + l (token-step
    t, layer l); keys are numbered l·n_experts + e, as `ExpertCache(..., n_layers, n_experts)`
    numbers them. `keys[offsets[j]:offsets[j+1]]` are the keys layer-step j accesses (the union
    over the batch, first appearance first, rank-major); likewise `scores` (key, router score
    summed over the batch, highest first) and `predicted` (keys to prefetch, best first)."""

    n_layers: int
    n_experts: int
    top_k: int
    batch_size: int
    keys: np.ndarray
    offsets: np.ndarray
    scores: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # keys, values, offsets
    predicted: tuple[np.ndarray, np.ndarray] | None = None  # keys, offsets
    score_top: int | None = None  # scores keep only each step's score_top highest (None: all)
    n_tokens: int | None = None  # trace rows replayed (None: n_steps · batch_size)
    forecasts: Forecasts | None = None  # keys, chances, later chances (or None), offsets per token-step
    next_predicted: tuple[np.ndarray, np.ndarray] | None = None  # per (t, l): keys forecast at t for (t+1, l)

    @property
    def n_steps(self) -> int:
        return (len(self.offsets) - 1) // self.n_layers if self.n_layers else 0

    @property
    def n_accesses(self) -> int:
        return len(self.keys)

    @property
    def tokens(self) -> int:
        """Generated tokens the replay stands for: the trace rows."""
        return self.n_tokens if self.n_tokens is not None else self.n_steps * self.batch_size

    @cached_property
    def max_layer_keys(self) -> int:
        """The most keys one layer-step accesses: the least capacity that can serve the replay."""
        return int(np.diff(self.offsets).max(initial=0))

    def future(self) -> np.ndarray:
        """Every access in replay order as [M, 2] (layer, expert): what Belady is given."""
        return self._pairs(self.keys)

    def _pairs(self, keys: np.ndarray) -> np.ndarray:
        return np.stack(np.divmod(keys, self.n_experts), axis=1)

    def as_lists(self) -> tuple[list, list | None, list | None]:
        """The replay as nested lists, [step][layer]: keys accessed, {expert: score}, keys
        predicted (for reading, and for driving an ExpertCache call by call)."""
        def by_step(items: list, offsets: np.ndarray) -> list:
            flat = [items[a:b] for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]
            return [flat[t * self.n_layers:(t + 1) * self.n_layers] for t in range(self.n_steps)]

        steps = by_step(list(map(tuple, self.future().tolist())), self.offsets)
        scores = predicted = None
        if self.scores is not None:
            keys, values, offsets = self.scores
            experts, values = by_step((keys % self.n_experts).tolist(), offsets), by_step(values.tolist(), offsets)
            scores = [[dict(zip(e, v)) for e, v in zip(step_e, step_v)] for step_e, step_v in zip(experts, values)]
        if self.predicted is not None:
            keys, offsets = self.predicted
            predicted = by_step(list(map(tuple, self._pairs(keys).tolist())), offsets)
        return steps, scores, predicted

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
        forecast_chances: np.ndarray | None = None,
        later_chances: np.ndarray | None = None,
        next_chances: np.ndarray | None = None,
        next_token_min_chance: float = 0.0,
        predicted_min_score: float | None = None,
    ) -> "Replay":
        """`topk_ids` [N, L, k] and `seq_id` [N] in trace order (a sequence's rows contiguous,
        in position order). `topt_ids`/`topt_logits` [N, L, T]: router scores for policies that
        use them (softmax over the top-T, summed over the batch); `score_top` keeps only each
        layer-step's highest few, which is exact for a policy whose `scores_used` <= score_top
        and makes the replay faster. `predicted_scores` [N, L, E]: each row's top `prefetch_k`
        (default k) experts per layer are prefetched, those scored `predicted_min_score` or more
        where it is given (above every score: cross-token prefetch alone). `forecast_chances` [N, L, E] in [0, 1]: each
        row's predicted chance that an expert is used soon (learned eviction); a step takes the
        largest over its batch; `later_chances` [N, L, E] likewise, counted from the row's next
        token on: a layer's keys take them once the step has run the layer. `next_chances`
        [N, L, E] in [0, 1]: each row's forecast chance that its sequence's next token uses an
        expert (cross-token prefetch, timed replays only): the `prefetch_k` likeliest per layer
        with a chance of at least `next_token_min_chance`, united over the batch."""
        topk_ids = np.asarray(topk_ids)
        if topk_ids.ndim != 3:
            raise ReplayInputError(f"topk_ids must be [N, L, k], got shape {topk_ids.shape}")
        n, n_layers, top_k = topk_ids.shape
        if n and topk_ids.min() < 0:
            raise ReplayInputError("topk_ids holds negative expert ids: drop padding rows before replaying")
        if n_experts is None:
            highs = [topk_ids.max(initial=-1)]
            if topt_ids is not None:
                highs.append(np.asarray(topt_ids).max(initial=-1))
            n_experts = int(max(highs)) + 1
            if predicted_scores is not None:
                n_experts = max(n_experts, np.asarray(predicted_scores).shape[2])
        if next_chances is not None and predicted_scores is None:
            raise ReplayInputError("next_chances (cross-token prefetch) extend predicted_scores: give both")
        _check_inputs(topk_ids, topt_ids, topt_logits, predicted_scores, n_experts)
        if next_chances is not None:
            _check_scores("next_chances", next_chances, (n, n_layers, n_experts))
        if len(seq_id) != n:
            raise ReplayInputError(f"seq_id has {len(seq_id)} rows, topk_ids {n}")
        if (topt_ids is None) != (topt_logits is None):
            raise ReplayInputError("give both topt_ids and topt_logits, or neither")
        rows = batch_rows(np.asarray(seq_id), batch_size)
        keys, offsets = _union_keys(topk_ids, rows, n_experts)
        scores = None
        if topt_ids is not None:
            scores = _router_scores(np.asarray(topt_ids), np.asarray(topt_logits), rows, n_experts, score_top)
        predicted = next_predicted = None
        if predicted_scores is not None:
            predicted = _predicted_keys(np.asarray(predicted_scores), top_k if prefetch_k is None else prefetch_k,
                                        rows, n_experts, predicted_min_score)
            next_predicted = None
            if next_chances is not None:
                next_predicted = _predicted_keys(np.asarray(next_chances), top_k if prefetch_k is None else prefetch_k,
                                                 rows, n_experts, next_token_min_chance)
        if later_chances is not None and forecast_chances is None:
            raise ReplayInputError("later_chances (a run layer's chances) refine forecast_chances: give both")
        forecasts = None
        if forecast_chances is not None:
            keys_fc, soon, steps = _forecast_steps("forecast_chances", np.asarray(forecast_chances), rows, n_experts)
            later = None
            if later_chances is not None:
                later = _forecast_steps("later_chances", np.asarray(later_chances), rows, n_experts)[1]
            forecasts = (keys_fc, soon, later, steps)
        return cls(n_layers, n_experts, top_k, batch_size, keys, offsets, scores, predicted, score_top, n, forecasts,
                   next_predicted)


def _check_inputs(topk_ids: np.ndarray, topt_ids: np.ndarray | None, topt_logits: np.ndarray | None,
                  predicted_scores: np.ndarray | None, n_experts: int) -> None:
    """Expert ids in 0..n_experts-1 and finite scores of the shapes `Replay.build` names: the
    compiled replay would index outside its arrays, or rank by NaN, otherwise."""
    n, n_layers, _ = topk_ids.shape
    _check_ids("topk_ids", topk_ids, n_experts)
    if topt_ids is not None and topt_logits is not None:
        topt_ids, topt_logits = np.asarray(topt_ids), np.asarray(topt_logits)
        if topt_ids.shape != topt_logits.shape or topt_ids.ndim != 3 or topt_ids.shape[:2] != (n, n_layers):
            raise ReplayInputError(f"topt_ids {list(topt_ids.shape)} and topt_logits {list(topt_logits.shape)} "
                                   f"must both be [{n}, {n_layers}, T]")
        _check_ids("topt_ids", topt_ids, n_experts)
        _check_finite("topt_logits", topt_logits)
    if predicted_scores is not None:
        _check_scores("predicted_scores", predicted_scores, (n, n_layers, n_experts))


def _check_scores(name: str, scores: np.ndarray, shape: tuple[int, int, int]) -> None:
    scores = np.asarray(scores)
    if scores.shape != shape:
        raise ReplayInputError(f"{name} has shape {list(scores.shape)}, expected {list(shape)}")
    _check_finite(name, scores)


def _check_ids(name: str, ids: np.ndarray, n_experts: int) -> None:
    outside = (ids < 0) | (ids >= n_experts)
    if outside.any():
        raise ReplayInputError(f"{name} holds expert id {ids[outside][0]}, outside 0..{n_experts - 1}; the trace "
                               "is damaged or from another model")


def _check_finite(name: str, scores: np.ndarray) -> None:
    if not np.isfinite(scores).all():
        raise ReplayInputError(f"{name} holds {scores[~np.isfinite(scores)][0]}; scores must be finite")


def batch_rows(seq_id: np.ndarray, batch_size: int) -> np.ndarray:
    """[steps, batch_size] row indices of each decode step, -1 where a sequence has ended:
    sequences grouped `batch_size` at a time step together."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    n = len(seq_id)
    if n == 0:
        return np.zeros((0, batch_size), np.int64)
    starts = np.flatnonzero(np.r_[True, seq_id[1:] != seq_id[:-1]])
    if len(np.unique(seq_id[starts])) != len(starts):
        raise ValueError("rows of one sequence must be contiguous in the trace (seq_id repeats later)")
    if batch_size == 1:
        return np.arange(n, dtype=np.int64)[:, None]
    lengths = np.diff(np.r_[starts, n])
    groups = []
    for g in range(0, len(starts), batch_size):
        group_starts, group_lengths = starts[g : g + batch_size], lengths[g : g + batch_size]
        t = np.arange(int(group_lengths.max()))[:, None]
        block = np.full((len(t), batch_size), -1, np.int64)
        block[:, : len(group_starts)] = np.where(t < group_lengths, group_starts + t, -1)
        groups.append(block)
    return np.concatenate(groups)


def batch_steps(seq_id: np.ndarray, batch_size: int) -> list[list[int]]:
    """Row indices of each decode step, a finished sequence dropped out of its batch."""
    return [[r for r in step if r >= 0] for step in batch_rows(seq_id, batch_size).tolist()]


def _layer_base(n_layers: int, n_experts: int) -> np.ndarray:
    return (np.arange(n_layers, dtype=np.int64) * n_experts)[:, None]


def _union_keys(ids: np.ndarray, rows: np.ndarray, n_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """Per step and layer, the keys of the rows' experts, first appearance first, rank-major:
    flat keys and offsets over layer-steps."""
    n_steps, batch = rows.shape
    _, n_layers, m = ids.shape
    grouped = ids[np.maximum(rows, 0)].astype(np.int64)  # [S, B, L, m]
    grouped[rows < 0] = -1
    grouped = grouped.transpose(0, 2, 3, 1).reshape(n_steps, n_layers, m * batch)  # rank-major
    keep = grouped >= 0
    if batch > 1:  # keep each expert's first appearance in its layer-step
        order = np.argsort(grouped, axis=-1, kind="stable")
        ordered = np.take_along_axis(grouped, order, -1)
        first = np.ones_like(keep)
        first[..., 1:] = ordered[..., 1:] != ordered[..., :-1]
        np.put_along_axis(keep, order, first & np.take_along_axis(keep, order, -1), -1)
    keys = (grouped + _layer_base(n_layers, n_experts))[keep]
    return keys, np.r_[0, np.cumsum(keep.sum(-1).ravel())].astype(np.int64)


def _router_scores(
    topt_ids: np.ndarray, topt_logits: np.ndarray, rows: np.ndarray, n_experts: int, score_top: int | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Softmax over each row's top-T logits, summed per step and layer over the batch, highest
    first (ties: the lower expert), the `score_top` highest if given: keys, values, offsets."""
    logits = topt_logits.astype(np.float64)
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    n_steps, batch = rows.shape
    n_layers = topt_ids.shape[1]
    if batch == 1:
        ids, summed = topt_ids[rows[:, 0]].astype(np.int64), probs[rows[:, 0]]
        order = np.argsort(-summed, axis=-1, kind="stable")
        ids, summed = np.take_along_axis(ids, order, -1), np.take_along_axis(summed, order, -1)
        keep = np.ones(ids.shape, bool)
    else:  # a dense [S, L, E] sum, rows added in batch order
        dense = np.zeros((n_steps, n_layers, n_experts))
        touched = np.zeros(dense.shape, bool)
        steps = np.arange(n_steps)[:, None, None]
        layers = np.arange(n_layers)[None, :, None]
        for b in range(batch):
            live = rows[:, b] >= 0
            r = rows[live, b]
            dense[steps[live], layers, topt_ids[r]] += probs[r]
            touched[steps[live], layers, topt_ids[r]] = True
        ids = np.argsort(np.where(touched, -dense, np.inf), axis=-1, kind="stable")
        summed, keep = np.take_along_axis(dense, ids, -1), np.take_along_axis(touched, ids, -1)
    if score_top is not None:
        ids, summed, keep = ids[..., :score_top], summed[..., :score_top], keep[..., :score_top]
    keys = (ids + _layer_base(n_layers, n_experts))[keep]
    return keys, summed[keep], np.r_[0, np.cumsum(keep.sum(-1).ravel())].astype(np.int64)


def _predicted_keys(
    predicted_scores: np.ndarray, m: int, rows: np.ndarray, n_experts: int, min_score: float | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Each row's top-m predicted experts per layer (those scored `min_score` or more), best
    first, united over the batch."""
    if not 1 <= m <= predicted_scores.shape[-1]:
        raise ValueError(f"prefetch_k must be in 1..{predicted_scores.shape[-1]} (the predicted experts), got {m}")
    top = np.argpartition(-predicted_scores, m - 1, axis=-1)[..., :m]
    top_scores = np.take_along_axis(predicted_scores, top, axis=-1)
    order = np.argsort(-top_scores, axis=-1, kind="stable")
    top = np.take_along_axis(top, order, axis=-1)
    if min_score is not None:
        top = np.where(np.take_along_axis(top_scores, order, axis=-1) >= min_score, top, -1)  # -1: dropped
    return _union_keys(top, rows, n_experts)


def _forecast_steps(name: str, chances: np.ndarray, rows: np.ndarray, n_experts: int) -> tuple[np.ndarray, ...]:
    """Per step, every key with the largest chance over the step's rows: keys, chances, offsets."""
    if chances.ndim != 3 or chances.shape[2] != n_experts:
        raise ValueError(f"{name} must be [N, L, {n_experts}], got shape {chances.shape}")
    if not np.isfinite(chances).all() or chances.min(initial=0.0) < 0 or chances.max(initial=0.0) > 1:
        raise ValueError(f"{name} must be finite chances in [0, 1]")
    n_steps, n_layers = len(rows), chances.shape[1]
    per_step = np.where((rows >= 0)[..., None, None], chances[np.maximum(rows, 0)], 0.0).max(axis=1)  # [S, L, E]
    keys = np.tile(np.arange(n_layers * n_experts, dtype=np.int64), n_steps)
    offsets = np.arange(n_steps + 1, dtype=np.int64) * n_layers * n_experts
    return keys, per_step.reshape(-1).astype(np.float64), offsets


@dataclass
class SimResult:
    policy: str
    capacity: int
    per_layer: bool
    batch_size: int
    layers_ahead: int | None
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
    timed: TimedStats | None = None  # with a LinkTiming: the clock, bytes moved and wasted
    expert_pipeline: bool | None = None  # timed: each expert computed as it lands (else per layer)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def stall_rate(self) -> float:
        return self.stalls / self.accesses if self.accesses else 0.0

    def to_dict(self) -> dict:
        """Every field, the rates, and, when timed, `TimedStats.to_dict`'s figures."""
        counts = {k: v for k, v in asdict(self).items() if k != "timed"}
        timed = self.timed.to_dict() if self.timed is not None else {}
        return {**counts, "hit_rate": self.hit_rate, "stall_rate": self.stall_rate, **timed}


def simulate(
    replay: Replay,
    capacity: int,
    policy: EvictionPolicy,
    per_layer: bool = False,
    layers_ahead: int | None = None,
    transfer_per_step: int | None = None,
    timing: LinkTiming | None = None,
    hide_only: bool = False,
    expert_pipeline: bool = True,
) -> SimResult:
    """Replay through a fresh ExpertCache(capacity, policy). Prefetches when the replay holds
    predictions. `policy` must be a new object (a policy serves one cache). Policies with
    `uses_scores` get the replay's router scores before each layer-step. With `timing` the
    replay runs on a clock (the module doc); `transfer_per_step` is the count-only link.
    `hide_only` (with `timing`): a prefetch is issued only if the link can move it before its
    layer starts, behind the copy in flight and the prefetches queued. `expert_pipeline` (with
    `timing`): each expert computes as its copy lands (as the runtime does by default);
    False: a layer-step computes once all its experts are in."""
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
    if layers_ahead is not None and layers_ahead < 1:
        raise ValueError(f"layers_ahead must be >= 1 or None, got {layers_ahead}")
    if transfer_per_step is not None and transfer_per_step < 0:
        raise ValueError(f"transfer_per_step must be >= 0 or None, got {transfer_per_step}")
    if timing is not None and not isinstance(timing, LinkTiming):
        raise TimingError(f"timing must be a LinkTiming(layer_compute_s, expert_bytes, link_bytes_per_s), "
                          f"got {type(timing).__name__}")
    if timing is not None and transfer_per_step is not None:
        raise ValueError("give timing (the timed link) or transfer_per_step (the count-only link), not both")
    if hide_only and timing is None:
        raise TimingError("hide_only weighs a prefetch's link time against compute: give timing too")
    if replay.next_predicted is not None and timing is None:
        raise TimingError("cross-token prefetch (a Replay with next_scores) hides loads behind compute: give timing")

    cache = ExpertCache(capacity, policy, per_layer=per_layer, n_layers=replay.n_layers, n_experts=replay.n_experts)
    if policy.uses_forecasts and replay.forecasts is None:
        raise ValueError(f"{name} ranks experts by forecasts: build the Replay with forecast_chances "
                         "(a predictor's chances of use)")
    replayed = {"scores": replay.scores if policy.uses_scores else None, "predicted": replay.predicted,
                "forecasts": replay.forecasts if policy.uses_forecasts else None,
                "layers_ahead": replay.n_layers if layers_ahead is None else min(layers_ahead, replay.n_layers)}
    started = time.perf_counter()
    timed = None
    if timing is None:
        late = cache.replay(replay.n_layers, replay.keys, replay.offsets, bandwidth=transfer_per_step, **replayed)
    else:
        late, clock, loads = cache.replay_timed(replay.n_layers, replay.keys, replay.offsets,
                                                timing.layer_compute_s, timing.transfer_s, hide_only=hide_only,
                                                next_predicted=replay.next_predicted, copy_s=timing.copy_s,
                                                expert_s=timing.expert_s, pipeline=expert_pipeline, **replayed)
        timed = TimedStats(timing, replay.tokens, float(clock[NOW]), float(clock[STALL]),
                           int(loads[DEMAND]), int(loads[PREFETCH]), int(loads[WASTED_LOADS]))
    seconds = time.perf_counter() - started
    s = cache.stats
    return SimResult(
        policy=name,
        capacity=capacity,
        per_layer=per_layer,
        batch_size=replay.batch_size,
        layers_ahead=layers_ahead,
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
        timed=timed,
        expert_pipeline=expert_pipeline if timing is not None else None,
    )


def expert_frequencies(topk_ids: np.ndarray, n_experts: int) -> np.ndarray:
    """[L, E] fraction of tokens routed to each expert (input of the static-hot policy)."""
    topk_ids = np.asarray(topk_ids)
    n, n_layers, _ = topk_ids.shape
    flat = (topk_ids + np.arange(n_layers)[None, :, None] * n_experts).ravel()
    counts = np.bincount(flat, minlength=n_layers * n_experts).reshape(n_layers, n_experts)
    return counts / max(n, 1)
