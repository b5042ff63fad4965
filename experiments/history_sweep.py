"""How learned eviction's blend of forecasts and history of use was chosen (`cache.history`): the
experts each policy loads per token, per held-out prompt, in the simulator, over the sequences a
`bench --memory` run decoded (its prompts and the plain model's tokens), at the slot counts its
caps gave:

    python -m experiments.history_sweep --bench results/bench-prediction-tb-guard2.json \
        --model runs/tb --predictor runs/demo/predictor/sida --slots 17,33,35 \
        --json results/learned-history-sweep.json

Per slot count: LRU, Belady's bound, learned eviction on the forecasts alone (weight 1.0), and the
blend at each decay and weight; for each, loads per token per prompt, their median, and the median
and largest per-prompt ratio over LRU's (the paired statistic of `bench --memory`). Count-only:
a load is a miss, whatever the link.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from cache import Replay, simulate
from experiments.compare_caches import build_predictor, forecast_inputs, policy_for
from prescient.atomic import write_json_atomic
from prescient.traces import Trace, load_trace

DECAYS = (0.8, 0.9, 0.95)
WEIGHTS = (0.3, 0.5, 0.7)


def trace_bench_sequences(bench: dict[str, Any], model_dir: str, out: str) -> None:
    """Trace each prompt of a `bench --memory` record followed by its plain reference tokens."""
    from prescient.arch import find_moe_layers
    from prescient.fingerprint import loaded_fingerprint
    from prescient.model_dir import ModelDirectory, model_class
    from prescient.traces import TraceManifest, TraceWriter
    from training.tracing import trace_windows

    directory = ModelDirectory.open(model_dir)
    model = model_class(directory.config).from_pretrained(directory.path).eval()
    tokenizer = directory.tokenizer()
    sequences = [tokenizer(prompt)["input_ids"] + reference["token_ids"]
                 for prompt, reference in zip(bench["settings"]["prompts"], bench["references"])]
    layers = find_moe_layers(model)
    fingerprint = loaded_fingerprint(directory, model, layers, next(model.parameters()).dtype)
    manifest = TraceManifest(fingerprint=fingerprint, dataset="bench --memory prompts", split="reference",
                             top_t=fingerprint.top_k, settings={"model": str(directory.path)})
    writer = TraceWriter(out, manifest)
    trace_windows(model, layers, sequences, writer, pad_id=tokenizer.pad_token_id or 0, top_t=manifest.top_t,
                  batch_size=1, shard_sequences=len(sequences))
    writer.finish()


def loads_per_token(trace: Trace, slots: int, policy: str, chances: dict[str, np.ndarray]) -> list[float]:
    """Per sequence of `trace`: the experts `policy` loads per token at `slots` (learned: `chances`)."""
    topk, seq = trace["topk_ids"].numpy(), trace["seq_id"].numpy()
    out = []
    for sequence in np.unique(seq):
        rows = seq == sequence
        replay = Replay.build(topk[rows], seq[rows], 1, n_experts=trace.fingerprint.n_experts,
                              **{name: values[rows] for name, values in chances.items()})
        out.append(simulate(replay, slots, policy_for(policy, replay, trace.fingerprint.top_k)).misses / rows.sum())
    return out


def summary(loads: list[float], lru: list[float]) -> dict[str, Any]:
    ratios = [mine / theirs for mine, theirs in zip(loads, lru)]
    return {"loads_per_token": loads, "median": statistics.median(loads),
            "over_lru": {"median": statistics.median(ratios), "max": max(ratios)}}


def sweep(trace: Trace, predictor: str, slot_counts: list[int]) -> list[dict[str, Any]]:
    """Every configuration at every slot count (see the module doc)."""
    _, pred, _ = build_predictor(predictor, trace, trace, "the same trace")
    blends = {(1.0, None): forecast_inputs(pred, trace, True, False, weight=1.0)}
    blends |= {(weight, decay): forecast_inputs(pred, trace, True, False, decay=decay, weight=weight)
               for decay in DECAYS for weight in WEIGHTS}
    results = []
    for slots in slot_counts:
        lru = loads_per_token(trace, slots, "lru", {})
        configs = [{"policy": "lru", **summary(lru, lru)},
                   {"policy": "belady", **summary(loads_per_token(trace, slots, "belady", {}), lru)}]
        configs += [{"policy": "learned-belady", "forecast_weight": weight, "decay": decay,
                     **summary(loads_per_token(trace, slots, "learned-belady", chances), lru)}
                    for (weight, decay), chances in blends.items()]
        results.append({"slots": slots, "configs": configs})
    return results


def bench_sweep_parser(description: str) -> argparse.ArgumentParser:
    """The arguments of a sweep over a `bench --memory` run's sequences (this one's, `prefetch_sweep`'s)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--bench", required=True, help="a bench --memory JSON: its prompts and reference tokens")
    parser.add_argument("--model", required=True, help="the model it ran")
    parser.add_argument("--predictor", required=True, help="a predictor artifact with forecast heads")
    parser.add_argument("--slots", required=True, help="comma list of slot counts")
    parser.add_argument("--json", required=True, help="results file")
    return parser


@contextmanager
def bench_trace(bench: dict[str, Any], model_dir: str) -> Iterator[Trace]:
    """The bench's sequences traced through `model_dir` into a temporary folder, for as long as the block runs."""
    with tempfile.TemporaryDirectory(prefix="bench-sequences-") as folder:
        trace_bench_sequences(bench, model_dir, folder)
        yield load_trace(folder)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = bench_sweep_parser(__doc__.split("\n\n")[0]).parse_args(argv)
    bench = json.loads(Path(args.bench).read_text())
    with bench_trace(bench, args.model) as trace:
        results = sweep(trace, args.predictor, [int(n) for n in args.slots.split(",")])
    record = {"what": "experts loaded per token by learned eviction blending forecasts with the history of use, "
                      "per held-out prompt, against LRU and Belady (simulator, count-only)",
              "command": "python -m experiments.history_sweep " + " ".join(argv),
              "settings": {"bench": args.bench, "model": args.model, "predictor": args.predictor,
                           "prompts": len(bench["settings"]["prompts"]), "decays": DECAYS, "weights": WEIGHTS},
              "results": results}
    write_json_atomic(args.json, record)


if __name__ == "__main__":
    main()
