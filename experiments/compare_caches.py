"""`prescient compare-caches`: cache policies replayed on a router trace, with and without
predictor prefetching; hit and stall rates, or with `--timing` simulated tokens/s, against
capacity (JSON + PNG).

    prescient compare-caches --trace DIR [--predictor PATH|corr|token|freq|oracle] [--train-trace DIR] \
        [--policies lru,lfu,fifo,mrs,static,belady] [--capacity 0.125,0.25,0.5,0.75] [--batch-size 1,8] \
        [--layers-ahead 1|all] [--transfer-per-step N] [--prefetch-k N] --json OUT.json [--plot OUT.png]

Every run replays the trace through the cache package's simulator (`cache.simulator`): decode
order, `batch_size` consecutive sequences stepping together, one global budget of `capacity`
slots over all L·E experts (a fraction of L·E, or an integer count). Each (batch size, policy,
capacity) runs on demand alone and, when a predictor is given, again with prefetching: each
row's top `prefetch_k` (default k) predicted experts per layer, the union over the batch,
loaded `layers_ahead` layers ahead (all layers at the token's start with `all`) over a link moving
`transfer_per_step` experts per layer compute (default: instant).

Predicted scores come from running the predictor as it would run while decoding: tables see the
token alone; a causal SiDA hash sees the sequence up to the token (`predict` over a traced window
equals stepping through it); a bidirectional one is stepped token by token (`start`/`step`), so it
never sees a future token; `oracle` is the trace's own router choices (the prefetch bound; its
certain forecasts of the next tokens bound learned eviction and `--next-token` too); `corr`
(Klotski) guesses layer 0 from its per-token table and, at 1 layer ahead, layer l+1 from the experts
the router truly chose at layer l (known when that prefetch is issued), else from its own guesses.
freq, token, corr and static-hot's frequencies are fit on `--train-trace`, or on the replayed trace
itself ("same trace (optimistic)").

A capacity below one layer-step's experts at the smallest batch size asked for is an error that
names the minimum; at a larger batch size (whose union of experts is larger) that capacity is
skipped, with a warning and an entry in `skipped`.

JSON: `trace`, `train_trace`, `predictor` (name, kind, sees, causal, ...), `predictor_fit_on`,
`static_fit_on`, `settings`, `min_capacity` (slots, per batch size), `skipped`, `runs` (one
record per simulation: policy, capacity, capacity_fraction, batch_size, prefetch, hit_rate,
stall_rate and every `SimResult` field), `timing`. Timed, each run is simulated once per entry
of `settings.expert_pipelines` (`expert_pipeline` true: each expert computes as its copy lands,
as the runtime does by default; false: a layer once all its experts are in), so both models
can be compared in one run; the table and the plot show the first.
"""

from __future__ import annotations

import logging
import time

import numpy as np
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from cache import POLICIES, EvictionPolicy, Replay, expert_frequencies, make_policy, simulate
from cache.history import DECAY, FORECAST_WEIGHT, blend, history_chances
from cache.timing import LinkTiming
from experiments.predictor_scores import forecast_scores, trace_scores
from predictor.base import ExpertPredictor, PredictorError
from predictor.forecast import chances_of_use
from predictor.registry import resolve_predictor
from prescient.atomic import write_atomic
from prescient.budget import Budget
from prescient.errors import CapacityError, PrescientError
from prescient.traces import Trace, load_trace

log = logging.getLogger(__name__)

DEFAULT_POLICIES = ("lru", "lfu", "fifo", "mrs", "static", "belady")
DEFAULT_CAPACITIES = (0.125, 0.25, 0.5, 0.75)
DEFAULT_BATCH_SIZES = (1, 8)
SAME_TRACE = "same trace (optimistic)"


class CompareCachesError(PrescientError):
    """A cache comparison was asked for with a bad policy, capacity, batch size or predictor."""


# --- inputs ------------------------------------------------------------------------------------
def check_policies(policies: tuple[str, ...]) -> tuple[str, ...]:
    names = tuple(p.strip().lower() for p in policies if p.strip())
    unknown = [p for p in names if p not in POLICIES]
    if unknown or not names:
        raise CompareCachesError(f"unknown cache policy {', '.join(map(repr, unknown)) or '(none given)'}; "
                                 f"known policies: {', '.join(POLICIES)}")
    return names


def capacity_slots(capacity: Budget | float | int, total: int) -> int:
    """Slots for a capacity: a Budget, a fraction of all `total` experts (float) or a count (int)."""
    if isinstance(capacity, bool) or not isinstance(capacity, (Budget, int, float)):
        raise CompareCachesError(f"capacity {capacity!r} is neither a fraction nor a slot count")
    try:
        budget = Budget(capacity, "slots") if isinstance(capacity, int) else Budget.of(capacity)
        slots = budget.slots(total)  # a byte budget has no expert size to divide by here
    except CapacityError as exc:
        raise CompareCachesError(f"capacity {capacity}: {exc}") from None
    if budget.unit == "fraction":
        return max(1, slots)
    if slots > total:
        raise CompareCachesError(f"capacity {slots} slots must be in 1..{total} (all experts)")
    return slots


def capacity_value(capacity: Budget | float | int) -> float | int:
    """A capacity as the JSON records it: a fraction, or a slot count."""
    if not isinstance(capacity, Budget):
        return capacity
    return capacity.amount if capacity.unit == "fraction" else int(capacity.amount)


def build_predictor(spec: str | Path | ExpertPredictor, trace: Trace, fit: Trace,
                    fit_on: str) -> tuple[str, ExpertPredictor, dict[str, Any]]:
    """(name, predictor, where it came from) for a built-in name, an artifact path or an object."""
    if isinstance(spec, ExpertPredictor):
        pred, source = resolve_predictor(spec.kind, spec, evaluated=trace, fit=fit, fit_on=fit_on)
        return spec.kind, pred, source
    name = str(spec)
    try:
        pred, source = resolve_predictor(name, None, evaluated=trace, fit=fit, fit_on=fit_on)
    except PredictorError as exc:  # an unknown name: the comparison's own error, named as such
        raise CompareCachesError(str(exc)) from None
    return (name if "artifact" not in source else Path(name).stem), pred, source


def forecast_inputs(pred: ExpertPredictor | None, trace: Trace, learned: bool, next_token: bool,
                    decay: float = DECAY, weight: float = FORECAST_WEIGHT) -> dict[str, np.ndarray]:
    """`Replay.build`'s `forecast_chances` and `later_chances` [N, L, E] (a learned policy ranks by
    them: chances of use soon, `predictor.forecast.chances_of_use`, `weight` of them blended with the
    history of use at `decay`, `cache.history`) and `next_chances` [N, L, E]
    (cross-token prefetch: each expert's chance of use by the next token), those asked for, from
    one pass of the predictor's forecasts."""
    if not (learned or next_token):
        return {}
    needed_by = "learned eviction" if learned else "cross-token prefetch"
    if pred is None:
        raise CompareCachesError(f"{needed_by} needs a predictor's forecasts: pass --predictor, an artifact with "
                                 "forecast heads (train one with --model.horizon 2)")
    pred.require_horizon(1)  # no heads: a ForecastHorizonError saying what to train
    current, ahead = forecast_scores(pred, trace, pred.horizon)
    top_k = trace.fingerprint.top_k
    inputs = {}
    if learned:
        soon, later = chances_of_use(current, ahead, top_k, to_chances=pred.chance_selected)
        # blended with each expert's use so far, as the runtime's learned eviction ranks (`cache.history`)
        used = history_chances(trace["topk_ids"].numpy(), trace["seq_id"].numpy(), trace.fingerprint.n_experts, decay)
        weight = 1.0 if pred.certain else weight  # the oracle's forecasts alone
        inputs.update(forecast_chances=blend(soon.numpy(), used, weight=weight),
                      later_chances=blend(later.numpy(), used, weight=weight))
    if next_token:
        inputs["next_chances"] = pred.chance_selected(ahead[:, 0], top_k).numpy()
    return inputs


def policy_for(name: str, replay: Replay, top_k: int, frequencies: np.ndarray | None = None) -> EvictionPolicy:
    """A fresh policy `name` for one simulation of `replay`, given what it reads: MRS the top-k,
    Belady the replay's future, static-hot the expert frequencies."""
    kwargs = {"mrs": {"top_k": top_k}, "belady": {"future": replay.future()},
              "static": {"frequencies": frequencies}}.get(name, {})
    return make_policy(name, **kwargs)


# --- the comparison ----------------------------------------------------------------------------
def compare_caches(
    trace_dir: str | Path,
    policies: tuple[str, ...] = DEFAULT_POLICIES,
    capacities: tuple[float | int, ...] = DEFAULT_CAPACITIES,
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES,
    predictor: str | Path | ExpertPredictor | None = None,
    train_trace: str | Path | None = None,
    layers_ahead: int | None = 1,
    transfer_per_step: int | None = None,
    prefetch_k: int | None = None,
    progress: bool = True,
    timing: LinkTiming | None = None,
    hide_only: bool = False,
    next_token: bool = False,
    next_token_min_chance: float = 0.5,
    expert_pipelines: tuple[bool, ...] = (True,),
) -> dict[str, Any]:
    """Replay the trace at `trace_dir` through every (batch size, policy, capacity), on demand
    and, with `predictor` (a built-in name, an artifact path or a built predictor),
    with prefetching. Returns the JSON of the module doc. With `timing` every run is timed
    (`cache.simulator`'s time-true model, instead of `transfer_per_step`'s count-only link) and
    its record gains simulated seconds, stall seconds, bytes moved and wasted per token and
    tokens/s (`cache.timing.TimedStats`); `settings.link_timing` holds the parameters. `hide_only`
    (with `timing`): prefetch only what the link can move before its layer runs. `next_token`
    (with `timing` and a predictor with forecast heads): cross-token prefetch, a layer `layers_ahead`
    steps on in the next token is prefetched from the forecast of that token, an expert only if
    its forecast chance of use is at least `next_token_min_chance`. `expert_pipelines` (timed):
    the runtime's layer models to simulate each run with (`simulate`'s `expert_pipeline`)."""
    start = time.perf_counter()
    policies = check_policies(tuple(policies))
    _check_link(batch_sizes, layers_ahead, transfer_per_step, timing, hide_only, next_token, predictor is not None)
    _check_expert_pipelines(expert_pipelines, timing)
    trace = load_trace(trace_dir)
    fp = trace.fingerprint
    total = fp.n_moe_layers * fp.n_experts
    slots = [capacity_slots(c, total) for c in capacities]
    if prefetch_k is not None and not 1 <= prefetch_k <= fp.n_experts:
        raise CompareCachesError(f"prefetch_k must be in 1..{fp.n_experts} (the experts of a layer), got {prefetch_k}")
    fit, fit_on = _fit_trace(trace, train_trace)

    result: dict[str, Any] = {
        "trace": trace.describe(trace_dir),
        "train_trace": fit.describe(train_trace) if train_trace is not None else None,
        "predictor": None, "predictor_fit_on": None,
        "static_fit_on": fit_on if "static" in policies else None,
    }
    scores = pred = None
    if predictor is not None:
        name, pred, source = build_predictor(predictor, trace, fit, fit_on)
    # before any scoring: a learned policy without a forecasting predictor is refused at once
    forecast = forecast_inputs(pred, trace, any(POLICIES[p].uses_forecasts for p in policies), next_token)
    chances = {name: forecast[name] for name in ("forecast_chances", "later_chances") if name in forecast}
    if predictor is not None:
        began = time.perf_counter()
        scores, info = trace_scores(pred, trace, name, decoding=True, true_previous_layer=layers_ahead == 1)
        scores = scores.numpy()
        result["predictor"] = {"name": name, "kind": pred.kind, **source, **info,
                               "seconds": round(time.perf_counter() - began, 3)}
        result["predictor_fit_on"] = source["fit_on"]
    result["settings"] = {
        "policies": list(policies), "capacities": [capacity_value(c) for c in capacities], "capacity_slots": slots,
        "total_experts": total, "budget": "global", "batch_sizes": list(batch_sizes),
        "layers_ahead": layers_ahead, "transfer_per_step": transfer_per_step,
        "link_timing": timing.to_dict() if timing is not None else None, "hide_only": hide_only,
        "next_token": next_token, "next_token_min_chance": next_token_min_chance if next_token else None,
        "expert_pipelines": list(expert_pipelines) if timing is not None else None,
        "prefetch_k": prefetch_k if prefetch_k is not None else fp.top_k,
        "mrs": {"alpha": 0.5, "p": 2 * fp.top_k},
    }

    replays = _replays(trace, batch_sizes, "mrs" in policies, chances, scores, prefetch_k=prefetch_k,
                       next_chances=forecast.get("next_chances"), next_token_min_chance=next_token_min_chance)
    need = {b: replays[b, False].max_layer_keys for b in batch_sizes}
    result["min_capacity"] = {str(b): n for b, n in need.items()}
    result["skipped"] = _fitting(capacities, slots, need, total)

    frequencies = expert_frequencies(fit["topk_ids"].numpy(), fp.n_experts) if "static" in policies else None
    runs = [(b, prefetch, policy, given, n, pipeline) for b in batch_sizes
            for prefetch in ((False, True) if scores is not None else (False,)) for policy in policies
            for given, n in zip(capacities, slots) if n >= need[b] for pipeline in expert_pipelines]
    result["runs"] = []
    for b, prefetch, policy, given, n, pipeline in tqdm(runs, desc="compare caches", unit="run", disable=not progress):
        replay = replays[b, prefetch]
        sim = simulate(replay, n, policy_for(policy, replay, fp.top_k, frequencies),
                       layers_ahead=layers_ahead if prefetch else None,
                       transfer_per_step=transfer_per_step if prefetch else None, timing=timing,
                       hide_only=hide_only and prefetch, expert_pipeline=pipeline)
        record = {"policy": policy, "capacity": n, "capacity_fraction": n / total,
                  "capacity_given": capacity_value(given), "batch_size": b, "prefetch": prefetch,
                  "hit_rate": sim.hit_rate, "stall_rate": sim.stall_rate}
        result["runs"].append({**record, **{k: v for k, v in sim.to_dict().items() if k not in record},
                               "policy_class": sim.policy, "trace_fingerprint": fp.weights_hash})
    result["timing"] = {"total_s": round(time.perf_counter() - start, 3),
                        "simulate_s": round(sum(r["seconds"] for r in result["runs"]), 3),
                        "accesses": sum(r["accesses"] for r in result["runs"])}
    return result


def _check_expert_pipelines(expert_pipelines: tuple[bool, ...], timing: LinkTiming | None) -> None:
    """The expert pipeline on or off is a model of the timed clock: one mode or both, with `timing` only."""
    if not expert_pipelines or (timing is None and expert_pipelines != (True,)):
        raise CompareCachesError("the expert pipeline on or off is a model of the timed clock: give --timing (and "
                                 f"one mode or both), got {list(expert_pipelines)}")


def _fit_trace(trace: Trace, train_trace: str | Path | None) -> tuple[Trace, str]:
    """The trace predictors and the static policy are fitted on (`train_trace`, checked to be of
    the same model, else `trace` itself) and how the JSON names it."""
    if train_trace is None:
        return trace, SAME_TRACE
    fit = load_trace(train_trace)
    trace.fingerprint.require_same(fit.fingerprint, f"train trace {train_trace}")
    return fit, str(train_trace)


def _replays(trace: Trace, batch_sizes: tuple[int, ...], router_scores: bool, chances: dict[str, np.ndarray],
             scores: np.ndarray | None, **prefetch: Any) -> dict[tuple[int, bool], Replay]:
    """Per (batch size, with prefetch) the replay of `trace`: on demand, and with the predicted
    `scores` (if any) prefetched as `prefetch` says; `router_scores`: with MRS's router scores."""
    fp = trace.fingerprint
    columns = {k: trace[k].numpy() for k in ("topk_ids", "seq_id", "topt_ids", "topt_logits")}
    router = {"topt_ids": columns["topt_ids"], "topt_logits": columns["topt_logits"], "score_top": 2 * fp.top_k} \
        if router_scores else {}
    replays: dict[tuple[int, bool], Replay] = {}
    for b in batch_sizes:
        replays[b, False] = Replay.build(columns["topk_ids"], columns["seq_id"], b, n_experts=fp.n_experts,
                                         **chances, **router)
        if scores is not None:
            replays[b, True] = Replay.build(columns["topk_ids"], columns["seq_id"], b, predicted_scores=scores,
                                            n_experts=fp.n_experts, **chances, **prefetch, **router)
    return replays


def _check_link(batch_sizes: tuple[int, ...], layers_ahead: int | None, transfer_per_step: int | None,
                timing: LinkTiming | None, hide_only: bool, next_token: bool, with_predictor: bool) -> None:
    """Refuse, before the trace is read, batch sizes and link settings that do not fit together."""
    if not batch_sizes or any(b < 1 for b in batch_sizes):
        raise CompareCachesError(f"batch sizes must be >= 1, got {list(batch_sizes)}")
    if layers_ahead is not None and layers_ahead < 1:
        raise CompareCachesError(f"layers_ahead must be >= 1 layer (or None: all layers), got {layers_ahead}")
    if transfer_per_step is not None and transfer_per_step < 0:
        raise CompareCachesError(f"transfer_per_step must be >= 0 experts (or None: instant), got {transfer_per_step}")
    if timing is not None and transfer_per_step is not None:
        raise CompareCachesError("give timing (the time-true link) or transfer_per_step (the count-only link), "
                                 "not both")
    if hide_only and timing is None:
        raise CompareCachesError("hide-only prefetch weighs each copy's link time against compute: give --timing")
    if next_token and (timing is None or not with_predictor):
        raise CompareCachesError("cross-token prefetch hides next-token loads behind compute: give --timing and a "
                                 "--predictor with forecast heads")


def _fitting(capacities: tuple[float | int, ...], slots: list[int], need: dict[int, int],
             total: int) -> list[dict[str, Any]]:
    """The (batch size, capacity) pairs skipped because a layer-step there needs more slots than
    the capacity has (`need`: per batch size); a capacity too small at the smallest batch size is
    a `CapacityError`."""
    smallest = min(need)
    for given, n in zip(capacities, slots):
        if n < need[smallest]:
            raise CapacityError(
                f"capacity {given} ({n} of {total} expert slots) cannot hold one layer-step's experts at "
                f"batch size {smallest}: the minimum is {need[smallest]} slots (a fraction of "
                f"{need[smallest] / total:.4g}); raise --capacity or lower --batch-size")
    skipped = [{"batch_size": b, "capacity": n, "capacity_given": capacity_value(given), "min_capacity": need[b]}
               for b in need for given, n in zip(capacities, slots) if n < need[b]]
    for skip in skipped:
        log.warning("skipping capacity %s (%d slots) at batch size %d: a layer-step there needs up to %d slots",
                    skip["capacity_given"], skip["capacity"], skip["batch_size"], skip["min_capacity"])
    return skipped


# --- output ------------------------------------------------------------------------------------
def format_table(result: dict[str, Any]) -> str:
    """One line per (batch size, policy, capacity): demand hit rate, and with prefetch the hit
    and stall rates; then one line per skipped (batch size, capacity), with the reason."""
    runs = {(r["batch_size"], r["policy"], r["capacity"], r["prefetch"]): r for r in _shown(result)}
    with_prefetch = result["predictor"] is not None
    head = f"{'B':>3} {'policy':<8} {'slots':>6} {'frac':>6} {'hit':>7} {'stall':>7}"
    if with_prefetch:
        head += f" | {'hit+pf':>7} {'stall+pf':>8}"
    lines = [head, "-" * len(head)]
    for (b, policy, n, prefetch), r in runs.items():
        if prefetch:
            continue
        line = f"{b:>3} {policy:<8} {n:>6} {r['capacity_fraction']:>6.3f} {r['hit_rate']:>7.3f} {r['stall_rate']:>7.3f}"
        if with_prefetch:
            p = runs[b, policy, n, True]
            line += f" | {p['hit_rate']:>7.3f} {p['stall_rate']:>8.3f}"
        lines.append(line)
    for skip in result["skipped"]:
        lines.append(f"skipped: capacity {skip['capacity_given']} ({skip['capacity']} slots) at batch size "
                     f"{skip['batch_size']}: a layer-step there uses up to {skip['min_capacity']} experts at once "
                     "(the union over the batch), more than the slots")
    return "\n".join(lines)


def _shown(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The runs of the first layer model simulated (all runs when untimed)."""
    first = (result["settings"].get("expert_pipelines") or [None])[0]
    return [r for r in result["runs"] if r.get("expert_pipeline") == first]


def plot_compare_caches(result: dict[str, Any], path: str | Path) -> Path:
    """One panel per batch size, one curve per policy against capacity: on demand (solid), with
    the predictor's prefetch (dash-dot), Belady's demand optimum (black, dashed). A time-true
    comparison (`--timing`) plots simulated tokens/s, where prefetching pays for the bytes it
    moves; a count-only one plots hit rate, and with a predictor a second row the stall rate with
    prefetch (a count-only prefetch hit is free, so its hit rate may sit above Belady's)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = result["settings"]
    batch_sizes, policies = settings["batch_sizes"], settings["policies"]
    prefetch = result["predictor"] is not None
    timed = settings.get("link_timing") is not None
    metric, label = ("tokens_per_s", "simulated tokens/s") if timed else ("hit_rate", "hit rate")
    rows = 2 if prefetch and not timed else 1
    fig, axes = plt.subplots(rows, len(batch_sizes), figsize=(5.5 * len(batch_sizes), 4.2 * rows),
                             squeeze=False, sharey="row")
    colors = {p: f"C{i}" for i, p in enumerate(policies)}

    def curve(b: int, policy: str, pf: bool, name: str) -> tuple[list[float], list[float]]:
        runs = sorted((r for r in _shown(result) if (r["batch_size"], r["policy"], r["prefetch"]) == (b, policy, pf)),
                      key=lambda r: r["capacity"])
        return [r["capacity_fraction"] for r in runs], [r[name] for r in runs]

    predictor = result["predictor"]["name"] if prefetch else None
    for col, b in enumerate(batch_sizes):
        ax = axes[0][col]
        for policy in policies:
            if policy == "belady":
                ax.plot(*curve(b, policy, False, metric), "k--", lw=2, label="belady (demand bound)")
                continue
            ax.plot(*curve(b, policy, False, metric), "o-", color=colors[policy], label=policy)
            if prefetch:
                ax.plot(*curve(b, policy, True, metric), "s-.", color=colors[policy], alpha=0.8,
                        label=f"{policy} + {predictor} prefetch")
        ax.set_title(f"{label}, batch size {b}")
        ax.set_xlabel("capacity (fraction of all experts)")
        ax.set_ylim(0, None if timed else 1.02)
        ax.grid(alpha=0.3)
        if prefetch and not timed:
            ax2 = axes[1][col]
            for policy in policies:
                if policy != "belady":
                    ax2.plot(*curve(b, policy, True, "stall_rate"), "s-.", color=colors[policy],
                             label=f"{policy} + {predictor}")
            if "belady" in policies:
                ax2.plot(*curve(b, "belady", False, "stall_rate"), "k--", lw=2, label="belady demand misses")
            ax2.set_title(f"stall rate with prefetch, batch size {b}")
            ax2.set_xlabel("capacity (fraction of all experts)")
            ax2.set_ylim(0, 1.02)
            ax2.grid(alpha=0.3)
    axes[0][0].set_ylabel(label)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    if prefetch and not timed:
        axes[1][0].set_ylabel("stall rate")
        axes[1][-1].legend(fontsize=7, loc="upper right")
    kind = "time-true, on this machine's simulated clock" if timed else "count-only"
    fig.suptitle(f"cache policies on {result['trace']['dataset']} ({result['trace']['n_tokens']} tokens; {kind})")
    fig.tight_layout()
    write_atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120))
    plt.close(fig)
    return Path(path)
