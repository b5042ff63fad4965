"""What prefetch can win beside learned eviction on a link the loads already fill: tokens/s per
held-out prompt in the timed simulator (`cache.simulate` with a `LinkTiming`), over the sequences a
`bench --memory` run decoded (its prompts and the plain model's tokens), at the slot counts its caps
gave:

    python -m experiments.prefetch_sweep --bench results/bench-prediction-tb-0.85-rotated.json \
        --model runs/tb --predictor runs/demo/predictor/sida-decode-h8 --slots 37 \
        --layer-ms 2.5 --read-ms 7.9 --json results/prefetch-sweep-tb.json

Per slot count, each prompt's sequence replayed alone from an empty cache, batch 1: LRU; learned
eviction alone (`--memory`'s default on the CPU); learned eviction with cross-token prefetch of the
next token's experts forecast at least 0.5, 0.7 or 0.9 likely (the model's top-k per layer at most),
alone or beside SiDA's in-token prefetch of the running token's top-k (what asking for cross-token
prefetch ran on the CPU before b325c84); and the oracle (learned eviction on the true routing, every
layer's experts and the next token's prefetched). A layer-step computes `--layer-ms` once its
experts are in, each expert computing as it lands; one link moves an expert in `--read-ms`, demand
loads before prefetches, one copy at a time (the runtime's one transfer worker reading at depth 1).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

from cache import Replay, simulate
from cache.timing import LinkTiming
from experiments.compare_caches import build_predictor, forecast_inputs, policy_for
from experiments.history_sweep import bench_sweep_parser, bench_trace
from experiments.predictor_scores import forecast_scores
from predictor.base import ExpertPredictor
from prescient.atomic import write_json_atomic
from prescient.traces import Trace

THRESHOLDS = (0.5, 0.7, 0.9)
NONE = 2.0  # a least score above every chance: no in-token prefetch


def configurations(trace: Trace, predictor: str | ExpertPredictor) -> dict[str, dict[str, Any]]:
    """Per configuration: its policy and the [N, L, E] arrays `Replay.build` takes (see the module doc)."""
    _, pred, _ = build_predictor(predictor, trace, trace, "the same trace")
    learned = forecast_inputs(pred, trace, True, True)
    current, _ = forecast_scores(pred, trace, pred.horizon)
    ranked = {"forecast_chances": learned["forecast_chances"], "later_chances": learned["later_chances"]}
    nothing_now = {"predicted_scores": np.zeros_like(current.numpy()), "predicted_min_score": NONE}
    configs = {"lru": {"policy": "lru"}, "learned": {"policy": "learned-belady", **ranked}}
    for least in THRESHOLDS:
        configs[f"learned+next>={least}"] = {"policy": "learned-belady", **ranked, **nothing_now,
                                             "next_chances": learned["next_chances"], "next_token_min_chance": least}
    configs["learned+in-token+next>=0.5"] = {"policy": "learned-belady", **ranked, "predicted_scores": current.numpy(),
                                             "predicted_min_score": 1e-9, "next_chances": learned["next_chances"],
                                             "next_token_min_chance": 0.5}
    _, oracle, _ = build_predictor("oracle", trace, trace, "the same trace")
    certain = forecast_inputs(oracle, trace, True, True)
    used = np.zeros_like(current.numpy())
    np.put_along_axis(used, trace["topk_ids"].numpy(), 1.0, axis=2)
    configs["oracle"] = {"policy": "learned-belady", "forecast_chances": certain["forecast_chances"],
                         "later_chances": certain["later_chances"], "predicted_scores": used,
                         "predicted_min_score": 0.5, "next_chances": certain["next_chances"],
                         "next_token_min_chance": 0.5}
    return configs


def replay_prompts(trace: Trace, slots: int, config: dict[str, Any], timing: LinkTiming) -> list[dict[str, float]]:
    """Each sequence of `trace` replayed alone under `config` at `slots`, on `timing`'s clock."""
    topk, seq = trace["topk_ids"].numpy(), trace["seq_id"].numpy()
    arrays = {name: value for name, value in config.items() if isinstance(value, np.ndarray)}
    scalars = {name: value for name, value in config.items() if name != "policy" and name not in arrays}
    out = []
    for sequence in np.unique(seq):
        rows = seq == sequence
        replay = Replay.build(topk[rows], seq[rows], 1, n_experts=trace.fingerprint.n_experts,
                              **{name: value[rows] for name, value in arrays.items()}, **scalars)
        timed = simulate(replay, slots, policy_for(config["policy"], replay, trace.fingerprint.top_k),
                         layers_ahead=None, timing=timing).timed
        tokens = int(rows.sum())
        out.append({"tokens_per_s": timed.tokens_per_s, "stall_ms_per_token": 1e3 * timed.stall_seconds / tokens,
                    "demand_loads": timed.demand_loads, "prefetch_loads": timed.prefetch_loads,
                    "wasted_loads": timed.wasted_loads, "tokens": tokens})
    return out


def sweep(trace: Trace, predictor: str | ExpertPredictor, slot_counts: list[int], timing: LinkTiming) -> list[dict[str, Any]]:
    """Every configuration at every slot count, with each prompt's speed over LRU's and learned eviction's."""
    configs = configurations(trace, predictor)
    results = []
    for slots in slot_counts:
        prompts = {name: replay_prompts(trace, slots, config, timing) for name, config in configs.items()}
        speed = {name: [p["tokens_per_s"] for p in rows] for name, rows in prompts.items()}
        rows = []
        for name, per_prompt in prompts.items():
            over = {base: [mine / theirs for mine, theirs in zip(speed[name], speed[base])] for base in ("lru", "learned")}
            rows.append({"config": name, "prompts": per_prompt,
                         **{f"over_{base}": {"per_prompt": ratios, "median": statistics.median(ratios)}
                            for base, ratios in over.items()}})
        results.append({"slots": slots, "configs": rows})
    return results


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = bench_sweep_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--layer-ms", type=float, required=True, help="one MoE layer-step's compute, ms")
    parser.add_argument("--read-ms", type=float, required=True, help="one expert's copy over the link, ms")
    args = parser.parse_args(argv)
    bench = json.loads(Path(args.bench).read_text())
    expert_bytes = float(next(r["runtime"]["slot_bytes"] / r["runtime"]["slots"] for r in bench["runs"]
                              if r.get("runtime") and r["runtime"].get("slots")))
    timing = LinkTiming(args.layer_ms / 1e3, expert_bytes, expert_bytes / (args.read_ms / 1e3))
    with bench_trace(bench, args.model) as trace:
        results = sweep(trace, args.predictor, [int(n) for n in args.slots.split(",")], timing)
    record = {"what": "decode tokens/s per held-out prompt in the timed simulator: learned eviction with and without "
                      "cross-token prefetch at several thresholds, against LRU and the oracle",
              "command": "python -m experiments.prefetch_sweep " + " ".join(argv),
              "settings": {"bench": args.bench, "model": args.model, "predictor": args.predictor,
                           "prompts": len(bench["settings"]["prompts"]), "timing": timing.to_dict(),
                           "thresholds": THRESHOLDS},
              "results": results}
    write_json_atomic(args.json, record)


if __name__ == "__main__":
    main()
