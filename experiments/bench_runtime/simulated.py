"""The time-true simulator's prediction beside each measured run of `prescient bench --simulate`.

The bench records the router's choices of the all-resident generation (the oracle trace: the same
tokens every exact run generates). Each distinct (predictor, policy, budget) of the bench is then
replayed on that trace by `cache.simulator` with the bench's own slot count, prefetching at the
token's start like the runtime's hash table (every later layer of the forward), learned policies
ranking by the predictor's forecasts, a run's prefetch modes as in the runtime (`hide`: gated by
the simulator's own link timing; `next`: cross-token prefetch from the forecast heads), on a `LinkTiming` calibrated from this bench JSON
(`experiments.timing_calibration.timing_from_bench`: all-resident compute, on-demand LRU's link).

What differs from the runtime, by construction: the simulator replays every trace row one token at
a time, the warm-up and the prompts included, while the runtime prefills a prompt in one forward
and times only the decode; its per-token figures are taken over all rows.

JSON: every run record gains `simulated` (tokens/s, stall ms/token, MB moved/token, hit rate);
`simulator` holds the calibration, the agreement over the distinct runs (the measured median
tokens/s beside the simulated one, the Spearman rank correlation between them and the median
relative error of the simulated tokens/s) and, per budget, the bounds: Belady on demand and the
physical limit (`bound`).
"""

from __future__ import annotations

from pathlib import Path
from statistics import median
from typing import Any

import pandas as pd

from cache import POLICIES, Replay, simulate
from cache.timing import LinkTiming
from experiments.compare_caches import (
    SAME_TRACE,
    build_predictor,
    forecast_inputs,
    policy_for,
)
from experiments.predictor_scores import trace_scores
from experiments.timing_calibration import Calibration, timing_from_bench
from prescient.budget import Budget
from prescient.fingerprint import ModelFingerprint
from prescient.traces import Trace, load_trace


def simulate_bench(result: dict[str, Any], trace_dir: str | Path, predictor_paths: dict[str, str],
                   next_token_min_chance: float = 0.5) -> None:
    """Add the module doc's `simulated` to every offloaded run of `result` and its `simulator`
    section. `predictor_paths`: the bench's predictor name -> artifact (the oracle: its trace);
    `next_token_min_chance`: cross-token prefetch's, for the runs with the `next` mode."""
    fingerprint = ModelFingerprint.from_dict(result["model"]["fingerprint"])
    calibration = timing_from_bench(result, fingerprint=fingerprint)
    trace = load_trace(trace_dir)
    fingerprint.require_same(trace.fingerprint, f"generation trace {trace_dir}")
    # the simulator does not model in-token lookahead (a guess from each layer's hidden state, which
    # a trace does not hold): those runs get no prediction
    runs = [r for r in result["runs"] if r.get("kind") == "offloaded" and r.get("exact")
            and "look" not in (r.get("modes") or ())]
    simulated: dict[str, dict[str, Any]] = {}
    for label in dict.fromkeys(r["label"] for r in runs):
        first = next(r for r in runs if r["label"] == label)
        simulated[label] = simulate_run(trace, first, predictor_paths.get(first["predictor"]), calibration.timing,
                                        next_token_min_chance)
    for run in runs:
        run["simulated"] = simulated[run["label"]]
    slots = {r["budget"]: r["simulated"]["slots"] for r in runs}
    bounds = {f"{budget:g}": bound(trace, n, calibration) for budget, n in sorted(slots.items())}
    result["simulator"] = {"calibration": calibration.to_dict(), "agreement": agreement(runs, simulated),
                           "bounds": bounds,
                           "method": " ".join(__doc__.split("\n\n")[1:3]).replace("\n", " ")}


def simulate_run(trace: Trace, run: dict[str, Any], predictor_path: str | None, timing: LinkTiming,
                 next_token_min_chance: float = 0.5) -> dict[str, Any]:
    """One bench run (its predictor, policy, slot count and prefetch modes) replayed on `trace`
    with `timing` (which the `hide` mode also weighs copies with)."""
    fp = trace.fingerprint
    total = fp.n_moe_layers * fp.n_experts
    slots = (run.get("stats") or {}).get("slots") or Budget.of(run["budget"]).slots(total)
    columns = {k: trace[k].numpy() for k in ("topk_ids", "seq_id", "topt_ids", "topt_logits")}
    build = {"n_experts": fp.n_experts}
    if run["policy"] == "mrs":
        build.update(topt_ids=columns["topt_ids"], topt_logits=columns["topt_logits"], score_top=2 * fp.top_k)
    pred = None
    if run["predictor"] != "none":
        spec = "oracle" if run["predictor"] == "oracle" else predictor_path
        _, pred, _ = build_predictor(spec, trace, trace, SAME_TRACE)
        scores, _ = trace_scores(pred, trace, run["predictor"], decoding=True, true_previous_layer=False)
        build["predicted_scores"] = scores.numpy()
    modes = run.get("modes") or ()
    build.update(forecast_inputs(pred, trace, POLICIES[run["policy"]].uses_forecasts, "next" in modes),
                 next_token_min_chance=next_token_min_chance)
    replay = Replay.build(columns["topk_ids"], columns["seq_id"], 1, **build)
    sim = simulate(replay, slots, policy_for(run["policy"], replay, fp.top_k), layers_ahead=None, timing=timing,
                   hide_only="hide" in modes, expert_pipeline="serial" not in modes)
    figures = sim.to_dict()
    return {"tokens_per_s": round(figures["tokens_per_s"], 3),
            "stall_ms_per_token": round(1e3 * figures["stall_seconds_per_token"], 2),
            "mb_moved_per_token": round(figures["bytes_moved_per_token"] / 1e6, 2),
            "hit_rate": round(sim.hit_rate, 4), "slots": slots, "rows": figures["tokens"]}


def bound(trace: Trace, slots: int, calibration: Calibration) -> dict[str, Any]:
    """Belady on demand at `slots` (the fewest loads any eviction makes) and the physical limit:
    the speed if only those loads were made and each hid behind compute, 1 / max(compute per
    token, Belady's bytes per token / link bytes/s)."""
    fp = trace.fingerprint
    replay = Replay.build(trace["topk_ids"].numpy(), trace["seq_id"].numpy(), 1, n_experts=fp.n_experts)
    timing = calibration.timing
    figures = simulate(replay, slots, policy_for("belady", replay, fp.top_k), timing=timing).to_dict()
    compute_s = calibration.source["token_compute_s"]
    link_s = figures["bytes_moved_per_token"] / timing.link_bytes_per_s
    return {"slots": slots, "belady_hit_rate": round(figures["hit_rate"], 4),
            "belady_mb_moved_per_token": round(figures["bytes_moved_per_token"] / 1e6, 2),
            "belady_simulated_tokens_per_s": round(figures["tokens_per_s"], 3),
            "compute_ms_per_token": round(1e3 * compute_s, 2), "belady_link_ms_per_token": round(1e3 * link_s, 2),
            "physical_limit_tokens_per_s": round(1 / max(compute_s, link_s), 3)}


def agreement(runs: list[dict[str, Any]], simulated: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Measured median tokens/s against simulated, per distinct run: Spearman and relative error."""
    rows = []
    for label, sim in simulated.items():
        measured = median(r["tokens_per_s"] for r in runs if r["label"] == label)
        rows.append({"label": label, "measured_median_tokens_per_s": round(measured, 3),
                     "simulated_tokens_per_s": sim["tokens_per_s"],
                     "relative_error": round(abs(sim["tokens_per_s"] - measured) / measured, 4)})
    table = pd.DataFrame(rows)
    pair = ["measured_median_tokens_per_s", "simulated_tokens_per_s"]
    # DataFrame.corr ranks in pandas itself (Series.corr would need scipy for Spearman)
    spearman = table[pair].corr(method="spearman").iloc[0, 1] if len(rows) > 1 else None
    return {"runs": rows, "spearman": None if spearman is None or pd.isna(spearman) else round(float(spearman), 4),
            "median_relative_error": round(float(table["relative_error"].median()), 4) if rows else None}
