"""The results page `demo`: `prescient demo` end to end on a tiny model, and how long it takes."""

from __future__ import annotations

from experiments.report_pages.rows import caches_timed_rows, evaluate_rows, forecast_rows
from experiments.report_tables import Page, Rows, Table, load, num


def page() -> Page:
    def timing() -> Rows:
        runs = {n: {s["step"]: s for s in load(n)["steps"]} for n in
                ("demo-timing-fresh-clone.json", "demo-timing-cold.json", "demo-timing-cached.json")}
        steps = list(next(iter(runs.values())))
        cell = lambda s: "reused" if s.get("reused") else num(s.get("seconds"), 1)  # noqa: E731
        rows = [[step, *(cell(r[step]) if step in r else "–" for r in runs.values())] for step in steps]
        rows.append(["**all steps**", *(num(load(n)["total_seconds"], 1) for n in runs)])
        return ["step", "fresh clone (s)", "cold (s)", "second run (s)"], rows

    def generation() -> Rows:
        rows = []
        for name in ("demo-generate-fresh-clone.json", "demo-generate.json"):
            d = load(name)
            s = d["settings"]
            rows.append([f"`{name}`", s["policy"], s["budget"], num(d["stats"]["hit_rate"], 3),
                         num(d["stats"]["prefetch_accuracy"], 3), d["stats"]["late_tables"],
                         "`" + d["text"].replace("\n", "⏎").replace("|", "\\|") + "`"])
        return ["JSON", "policy", "budget", "hit rate", "prefetch accuracy", "late hash tables", "generated text"], rows

    return Page("demo", "The demo", """
`prescient demo` runs the whole pipeline on a tiny reference model in about a quarter of an hour on
two CPU cores, most of it training the model and the predictor, and a second run reuses every
output. Conclude from its numbers that the pipeline works end to end, not how fast the project is:
the tiny model's simulated speeds are on a link and compute far smaller than a real model's. What
carries over is the ordering: on the simulator's clock, learned eviction beats LRU at every
capacity, and prefetching pays for the bytes it moves, so a prefetch's higher hit rate is not a
higher speed.
""", (
        Table("Seconds per step", ("demo-timing-fresh-clone.json", "demo-timing-cold.json", "demo-timing-cached.json"),
              "prescient demo --out runs/demo", timing,
              note="The demo writes `DIR/demo-timing-<time>.json` itself; each run on a fresh clone with the README's "
                   "venv, the pip and datasets caches warm, nothing else running."),
        Table("Predictors of the demo's tiny model", ("demo-evaluate-fresh-clone.json",),
              "prescient evaluate --trace runs/demo/traces/validation --predictors sida=...,corr,token,freq,lookahead,oracle",
              lambda: evaluate_rows("demo-evaluate-fresh-clone.json")),
        Table("Forecasts of the demo's SiDA (two heads)", ("demo-evaluate-fresh-clone.json",),
              "the same `prescient evaluate` run", lambda: forecast_rows("demo-evaluate-fresh-clone.json", "sida")),
        Table("Time-true cache comparison, batch 1", ("demo-compare-caches-fresh-clone.json",),
              "prescient compare-caches --trace runs/demo/traces/validation --predictor runs/demo/predictor/sida "
              "--policies lru,lfu,fifo,mrs,static,belady,learned-belady --timing runs/demo/hardware.json "
              "--model-config runs/demo/model", lambda: caches_timed_rows("demo-compare-caches-fresh-clone.json"),
              note="The plot beside the JSON (`results/demo-compare-caches-fresh-clone.png`) draws these "
                   "tokens/s per policy against capacity, at batch sizes 1 and 8."),
        Table("Offloaded generation", ("demo-generate-fresh-clone.json", "demo-generate.json"),
              "prescient generate --model runs/demo/model --predictor runs/demo/predictor/sida --policy "
              "learned-belady --budget 0.5 --sample 0 --temperature 0.7 --top-p 0.9", generation,
              note="The second JSON is an earlier demo's: greedy, MRS."),
    ))
