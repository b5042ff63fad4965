"""The results pages: for each, what a reader should conclude and the tables that show it, each
table read from the JSONs in `results/` that the command beside it wrote. Rendered by
`prescient report` (the engine, `experiments/report.py`)."""

from __future__ import annotations

from statistics import median
from typing import Any

from experiments.report_tables import RESULTS, Headline, Page, Rows, Table, load, num, pct, spread

CODE, DOCS = "stdlib-code", "stdlib-docs"
W1T = "OMP_NUM_THREADS=1"


# --- row builders shared by several tables -------------------------------------------------------
def routing_rows(stats: dict[str, Any]) -> Rows:
    layers = range(stats["layers"])
    header = ["per MoE layer", *map(str, layers), "mean, layers 1–"]
    header[-1] += str(stats["layers"] - 1)
    summary = stats["summary"]
    rows = []
    for label, key, mean in (("gate-lookahead recall@k", "lookahead_recall", "lookahead_recall"),
                             ("per-token-id table recall@k", "token_table_recall", "token_table_recall"),
                             ("top-1 kept by the next token", "top1_repeat", "top1_repeat"),
                             ("the same by chance (same load)", "top1_repeat_chance", "top1_repeat_chance"),
                             ("router entropy / log E", "router_entropy_share", "router_entropy_share")):
        rows.append([label, *(num(v) for v in stats[key]), num(summary[mean], 3)])
    loads = [v for layer in stats["expert_load"] for v in layer]
    rows.append(["expert's share of its layer's load, min–max", *(f"{num(min(l), 3)}–{num(max(l), 3)}"
                                                                   for l in stats["expert_load"]),
                 f"{num(min(loads), 3)}–{num(max(loads), 3)}"])
    return header, rows


def quality_cells(name: str) -> list[str]:
    """Perplexity change, KL and top-1 agreement on code / docs of a `prescient quality` JSON."""
    d = load(name)["datasets"]
    c, o = d[CODE], d[DOCS]
    return [f"{pct(c['perplexity_increase'])} / {pct(o['perplexity_increase'])}",
            f"{num(c['kl_nats'], 4)} / {num(o['kl_nats'], 4)}",
            f"{num(c['top1_agreement'], 3)} / {num(o['top1_agreement'], 3)}"]


def quality_rows(names: list[str]) -> Rows:
    rows = []
    for name in names:
        d = load(name)
        slots = d.get("slot_format") or "–"
        options = d.get("options") or {}
        fine = options.get("fine_model")
        mixed = f"{fine} ({options['precision_rule']}, share {options['fine_share']})" if fine else "–"
        share = d["datasets"][CODE].get("fine_share")
        rows.append([f"`{d['model']}`", d.get("dtype", "float32"), slots, "decode" if d.get("decode") else "teacher-forced",
                     d["windows"], mixed, num(share) if share is not None else "–", *quality_cells(name)])
    return (["model", "dtype", "slots", "mode", "windows", "fine copy (rule, share)", "fine share of uses",
             "perplexity change code / docs", "KL code / docs (nats)", "top-1 agreement code / docs"], rows)


def bench_rows(name: str) -> Rows:
    """`prescient bench`: per run label the repeats' tokens/s, median, × on-demand LRU at the same
    budget, and the medians of stall, bytes, hit rate and simulated tokens/s."""
    d = load(name)
    ratios = d["ratios"]
    header = ["run", "tokens/s per repeat", "median", "× LRU", "stall ms/token", "MB/token", "hit rate",
              "simulated tokens/s", "peak RSS (MB)", "exact"]
    rows = [[f"{b} (baseline)", "", num(r["tokens_per_s"]), "", "", "", "", "", num(r["peak_rss_mb"], 0),
             "yes" if r["exact"] else "no"] for b, r in d["baselines"].items()]
    def vs_lru(label: str) -> str:
        lru = ratios.get(f"none+lru@{label.split('@')[1].split('+')[0]}")
        return num(ratios[label]["tokens_per_s"] / lru["tokens_per_s"]) if lru and label in ratios else "–"

    by_label: dict[str, list[dict]] = {}
    for r in d["runs"]:
        by_label.setdefault(r["label"], []).append(r)
    for label, runs in by_label.items():
        ratio = ratios.get(label, {})
        med = lambda f: median(f(r) for r in runs)  # noqa: E731
        simulated = [r["simulated"]["tokens_per_s"] for r in runs if r.get("simulated")]
        rows.append([f"`{label}`", ", ".join(num(r["tokens_per_s"]) for r in runs),
                     num(ratio.get("tokens_per_s", med(lambda r: r["tokens_per_s"]))),
                     vs_lru(label),
                     num(med(lambda r: 1000 * r["stall_seconds"] / r["decode_tokens"]), 1),
                     num(med(lambda r: r["bytes_moved"] / r["decode_tokens"] / 1e6), 1),
                     num(med(lambda r: r["hit_rate"]), 3), num(median(simulated)) if simulated else "–",
                     num(med(lambda r: r["peak_rss_mb"]), 0), "yes" if all(r["exact"] for r in runs) else "no"])
    return header, rows


def bench_note(name: str) -> str:
    """The simulator's agreement and bounds of a `prescient bench --simulate` run, or the hash
    thread's cost of a `--hash-cost` run."""
    d = load(name)
    cost, sim = d.get("hash_thread_cost"), d.get("simulator")
    if cost:
        on, off = cost["with_thread_tables_ignored"], cost["without_thread"]
        return (f"The hash-building thread ({cost['predictor']}, its tables ignored, budget {cost['budget']}) against "
                f"no thread: {num(on['tokens_per_s'])} against {num(off['tokens_per_s'])} tokens/s "
                f"({num(on['tokens_per_s'] / off['tokens_per_s'])}×, one run each).")
    if not sim:
        return ""
    agree, bounds = sim["agreement"], sim["bounds"]
    parts = [f"Simulator against runtime: Spearman {num(agree['spearman'], 3)}, median relative error "
             f"{pct(agree['median_relative_error'], 1, signed=False)}."]
    for budget, b in bounds.items():
        parts.append(f"At {pct(float(budget), 0, signed=False)}: Belady's offline eviction "
                     f"{num(b['belady_simulated_tokens_per_s'])} simulated tokens/s, physical limit "
                     f"{num(b['physical_limit_tokens_per_s'])}.")
    return " ".join(parts)


def compressed_rows(name: str) -> Rows:
    """`prescient bench-compressed`: per model and run, tokens/s median (range) and the rest."""
    d = load(name)
    rows = []
    for model, runs in d["summary"].items():
        q = d["models"][model].get("quality")
        qcells = ["–", "–"]
        if q:
            c, o = q["datasets"][CODE], q["datasets"][DOCS]
            qcells = [f"{pct(c['perplexity_increase'])} / {pct(o['perplexity_increase'])}",
                      f"{num(c['kl_nats'], 4)} / {num(o['kl_nats'], 4)}"]
        for label, r in runs.items():
            rows.append([model, f"`{label}`", spread(r["tokens_per_s"], r["tokens_per_s_range"]), num(r.get("vs_bf16")),
                         num(r.get("stall_ms_per_token"), 1), num(r.get("mb_moved_per_token"), 1), num(r.get("hit_rate"), 3),
                         num(r.get("fine_share"), 3), *qcells])
    return (["experts", "run", "tokens/s median (range)", "× bf16 LRU", "stall ms/token", "MB/token", "hit rate",
             "fine share of uses", "perplexity change code / docs", "KL code / docs"], rows)


def caches_timed_rows(name: str, batch: int = 1) -> Rows:
    """A time-true `prescient compare-caches`: per capacity, policy and prefetch, the simulated clock."""
    d = load(name)
    rows = []
    for r in sorted((r for r in d["runs"] if r["batch_size"] == batch),
                    key=lambda r: (-r["capacity_fraction"], r["prefetch"], r["policy"])):
        rows.append([pct(r["capacity_fraction"], 1, signed=False), r["policy"],
                     d["predictor"]["name"] if r["prefetch"] else "on demand",
                     num(r["hit_rate"], 3), num(r["stall_rate"], 3), num(1000 * r["stall_seconds_per_token"], 1),
                     num(r["bytes_moved_per_token"] / 1e6, 1), num(r["tokens_per_s"], 2)])
    return (["capacity", "policy", "prefetch", "hit rate", "stall rate", "stall ms/token", "MB moved/token",
             "simulated tokens/s"], rows)


def evaluate_rows(name: str) -> Rows:
    d = load(name)
    rows = []
    for pred, r in d["predictors"].items():
        b = r.get("batch", {})
        cell = lambda n: f"{num(b[n]['precision'], 3)} / {num(b[n]['recall'], 3)}" if n in b else "–"  # noqa: E731
        rows.append([pred, r.get("sees", ""), num(r["recall_at_k"], 3), num(r["recall_at_2k"], 3), cell("8"), cell("32")])
    return ["predictor", "sees", "recall@k", "recall@2k", "batch 8 precision / recall",
            "batch 32 precision / recall"], rows


def forecast_rows(name: str, forecaster: str) -> Rows:
    f = load(name)["forecasts"][forecaster]
    horizons = [h for h in ("1", "2", "4", "8") if int(h) <= f["horizon"]]
    rows = [[n, v["sees"], *(num(v["horizons"][h]["recall_at_2k"], 3) if h in v["horizons"] else "–" for h in horizons)]
            for n, v in f["forecasters"].items()]
    return ["forecaster", "sees", *(f"t+{h} recall@2k" for h in horizons)], rows


def serve_rows(name: str) -> Rows:
    d = load(name)
    rows = []
    for pred, per_clients in d["summary"].items():
        for clients, s in per_clients.items():
            rows.append([pred, clients, spread(s["tokens_per_s_median"], s["tokens_per_s_range"], 1),
                         num(s["speedup_over_1_client_median"]), num(s["ttft_p50_s_median"]),
                         num(s["latency_p50_s_median"]), s["refused"], s["lost"]])
    return ["predictor", "clients", "tokens/s median (range)", "× 1 client", "time to first token p50 (s)",
            "latency p50 (s)", "refused", "lost"], rows


# --- the pages -----------------------------------------------------------------------------------
def reference_pages() -> Page:
    base = load("reference-base.json")

    def curve() -> Rows:
        return (["step", f"{CODE} (nats/token)", f"{DOCS} (nats/token)"],
                [[p["step"], num(p["val_loss"][CODE]), num(p["val_loss"][DOCS])] for p in base["val_curve"]])

    def recipes() -> Rows:
        rows = []
        for name in ("reference-base.json", "reference-tiny-demo.json", "reference-tiny.json"):
            r = load(name)
            m = r["recipe"]["model"] if "model" in r["recipe"] else {}
            imp = r.get("last_tenth_improvement")
            rows.append([f"`{name}`", r["size"], m.get("num_hidden_layers", "–"), m.get("hidden_size", "–"),
                         num(r["val_loss"][CODE], 3), num(r["val_loss"][DOCS], 3),
                         pct(imp[CODE], 2, signed=False) if imp else "–", num(r["train_seconds"], 0)])
        return (["JSON", "size", "layers", "hidden", f"{CODE} loss", f"{DOCS} loss",
                 "improvement over the last tenth of the steps", "training seconds"], rows)

    return Page("reference-model", "The reference model", """
Every measurement in this project runs on a reference MoE the project trains itself (no model hub is
reachable here): a Mixtral-architecture model with 8 MoE layers of 16 experts, top-2. Conclude that it
has learned (its validation loss fell from about 5 to under 3 nats per token and was still creeping
down at the end) and that it routes like a real MoE in the ways that matter to prefetching: the next
layer's router applied to this layer's input guesses most of the next layer's experts, a token's
identity alone guesses fewer, and load is balanced, so a cache has little skew to exploit. It is
smaller and flatter than a production MoE, which bounds how far its numbers carry.
""", (
        Table("Validation loss of the base recipe", ("reference-base.json",),
              "prescient reference-model --size bench --out runs/reference-bench", curve,
              note="`--size bench` trains the base recipe and widens it; this is the base model's own `reference.json`."),
        Table("The recipes tried", ("reference-base.json", "reference-tiny-demo.json", "reference-tiny.json"),
              "prescient reference-model --size base|tiny", recipes, note="`reference-tiny-demo.json` is the tiny recipe as the demo builds it."),
        Table("Routing of the base model on held-out stdlib-code", ("routing-base.json",),
              "prescient routing-stats --model runs/reference-bench-base --json results/routing-base.json "
              "--plot results/routing-base.png", lambda: routing_rows(load("routing-base.json")["statistics"]),
              note="Real MoEs, for comparison: gate lookahead 0.93–0.976 from hidden states (Zhu et al.; "
                   "DeepSeek-V2-Lite, Qwen3-30B-A3B, Phi-mini-MoE), about 0.97 from the previous layer's gate "
                   "input (Fate); Mixtral keeps its top-1 expert above chance at its middle and last layers."),
        Table("Routing of the base model on held-out stdlib-docs", ("routing-base-docs.json",),
              "prescient routing-stats --model runs/reference-bench-base --dataset stdlib-docs --json ...",
              lambda: routing_rows(load("routing-base-docs.json")["statistics"])),
    ))


def demo_page() -> Page:
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


def probe_rows() -> Rows:
    """recall@k per layer, a layers ahead, of the hidden-state probe and gate lookahead."""
    predictors = load("evaluate-probe-short.json")["predictors"]
    rows = []
    for name, label in (("probe", "trained probe"), ("lookahead", "gate lookahead")):
        for a, r in predictors[name]["ahead"].items():
            per_layer = r["per_layer"]["recall_at_k"]
            rows.append([label, a, *(num(v, 3) for v in per_layer), num(r["recall_at_k"], 3)])
    n = len(per_layer)
    return ["predictor", "layers ahead", *(f"layer {i}" for i in range(n)), "mean"], rows


def predictors_page() -> Page:
    def ablation() -> Rows:
        d = load("sida-ablation-base.json")
        rows = [[v, num(r["best"]["val/recall_at_k"], 3), num(r["best"]["val/recall_at_2k"], 3), num(r["seconds"], 1)]
                for v, r in d["variants"].items()]
        rows += [[f"{b} (baseline)", num(r["recall_at_k"], 3), num(r["recall_at_2k"], 3), "–"]
                 for b, r in d["baselines"].items()]
        return ["loss variant", "recall@k", "recall@2k", "seconds"], rows

    def cross() -> Rows:
        c = load("cross-dataset.json")["cross_dataset"]
        rows = []
        for kind in ("predictor", "token"):
            for trained in c["train_datasets"]:
                rows.append([f"{'SiDA' if kind == 'predictor' else 'token table'}, trained on {trained}",
                             *(num(c[kind]["recall_at_k"][trained][ev], 3) for ev in c["datasets"])])
        return ["recall@k: trained on ↓ / evaluated on →", *c["datasets"]], rows

    def ceiling() -> Rows:
        d = load("next-token-ceiling-base.json")
        p = d["state_probes"]["inputs"]
        rows = [["the forecaster's head (token ids up to t)", "before token t's forward", num(d["forecaster_recall_at_2k"], 3), "–"]]
        for key, label, when in (("step_start", "probe on token t−1's final state and token t's embedding", "before token t's forward"),
                                 ("mid_forward", "probe on the middle layer's input at token t", "halfway through token t's forward"),
                                 ("forward_end", "probe on token t's final hidden state", "after token t's forward")):
            rows.append([label, when, num(p[key]["recall_at_2k"], 3), num(p[key]["blend_recall_at_2k"], 3)])
        for m, r in d["top_m"].items():
            rows.append([f"the LM's top-{m} guesses through the model's routers in context (true token in top-{m}: "
                         f"{pct(r['next_in_top_m'], 1, signed=False)})", "after token t's forward",
                         num(r["lm_top_m_in_context_recall_at_2k"], 3), num(r["in_context_blend_recall_at_2k"], 3)])
        return ["what the forecast of token t+1 reads", "when it exists", "t+1 recall@2k", "blended with the forecaster"], rows

    def costs() -> Rows:
        lat, tr = load("sida-latency-reference-base.json"), load("bench-tracing-reference-base.json")
        return ["measure", "value"], [
            ["SiDA hash function, one decode step for all layers: median / p99 ms", f"{num(lat['ms_per_token_median'], 3)} / {num(lat['ms_per_token_p99'], 3)}"],
            ["its CPU ms per step", num(lat["cpu_ms_per_token"], 3)],
            ["plain forward tokens/s / traced tokens/s", f"{num(tr['plain_tokens_per_s'], 0)} / {num(tr['traced_tokens_per_s'], 0)}"],
            ["tracing overhead", pct(tr["overhead_pct"] / 100, 2)],
        ]

    def meta() -> Rows:
        m = load("sida-predictor-base.json")
        t = m["training"]["config"]
        return ["predictor artifact", "kind", "trained on", "max time", "horizon", "validation recall@k / @2k"], [[
            f"`{t['export']}`", m["kind"], f"{m['training']['n_tokens']} tokens of {m['training']['dataset']}",
            t["trainer"]["max_time"], t["model"]["horizon"],
            f"{num(m['metrics']['val/recall_at_k'], 3)} / {num(m['metrics']['val/recall_at_2k'], 3)}"]]

    return Page("predictors", "Predictors and forecasts", """
On the base model SiDA's hash function guesses the current token's experts best of every predictor
that does not read the trace, ahead of gate lookahead and a per-token table, and does so on the
corpus it was not trained on too; its own loss (SiDA's) is as good as any variant tried. Forecasting
the *next* tokens' experts is much harder: the forecast heads beat every training-free forecaster,
but no forecast available in time reaches the 0.80 recall that would make learned eviction close
the gap to Belady. The hash function costs a fraction of a millisecond per token and tracing costs
nothing measurable, so prediction is cheap; its accuracy is the limit. Inside a token, a small
probe trained on each layer's hidden state guesses the next layers' experts far better than the
next layers' own routers do, on a barely trained stand-in; it is not yet measured on the base model.
""", (
        Table("Predictors on the base model", ("evaluate-base.json",),
              "prescient evaluate --trace runs/base-traces/validation --train-trace runs/base-traces/train --model "
              "runs/reference-bench-base --predictors sida=runs/base-predictor/sida,corr,token,freq,lookahead,oracle",
              lambda: evaluate_rows("evaluate-base.json")),
        Table("The SiDA artifact evaluated above", ("sida-predictor-base.json",),
              "prescient train --config configs/predictor/sida.yaml --data.trace_dir runs/base-traces/train "
              "--trainer.max_time 00:00:08:00 --export runs/base-predictor/sida", meta),
        Table("Loss ablation (300 steps each, held-out tenth of the training trace)", ("sida-ablation-base.json",),
              "prescient ablation runs/base-traces/train OUT.json --model runs/reference-bench-base --max-steps 300 "
              "--variants paper,kl,ce1,bce0.1,topk_ce0.1,topk_ce_only", ablation),
        Table("Across corpora", ("cross-dataset.json",),
              "prescient evaluate --model runs/reference-bench-base --trace runs/base-traces/validation --predictors "
              "token --cross code=...,docs=...", cross,
              note="Each SiDA trained with configs/predictor/sida.yaml for at most 8 minutes on 300 000 tokens of its corpus."),
        Table("Forecasts of the next tokens' experts", ("evaluate-forecast-base.json",),
              "prescient evaluate --trace runs/base-traces/validation --train-trace runs/base-traces/train "
              "--predictors sida=runs/base-predictor/sida,sida-h8=runs/forecast-base/sida-h8,token,freq",
              lambda: forecast_rows("evaluate-forecast-base.json", "sida-h8"),
              note="sida-h8 is configs/predictor/sida.yaml trained with `--model.horizon 8 --trainer.max_time 00:00:12:00`."),
        Table("Where a forecast of token t+1 can reach", ("next-token-ceiling-base.json",),
              "python -m experiments.next_token_ceiling --model runs/reference-bench-base --train-trace "
              "runs/base-traces/train --forecaster runs/forecast-base/sida-h8 --in-context --probe-windows 400", ceiling),
        Table("In-token lookahead: a trained hidden-state probe against gate lookahead, 1-3 layers ahead",
              ("evaluate-probe-short.json",),
              "prescient evaluate --trace runs/probe-short/trace-val --train-trace runs/probe-short/trace-train --model "
              "runs/short --predictors lookahead,probe=runs/probe-short/probe,token,freq --batch-sizes 1,8 --ahead 3",
              probe_rows,
              note="Not the base model: `runs/short` is the tiny recipe trained 40 steps (validation loss 6.86 nats, "
                   "routing very skewed). The probe: `prescient trace ... --hidden-states` on 200 000 train tokens, "
                   "`prescient train --config configs/predictor/probe.yaml --trainer.max_time 00:00:18:00`; evaluated "
                   "on 50 000 validation tokens."),
        Table("What prediction and tracing cost", ("sida-latency-reference-base.json", "bench-tracing-reference-base.json"),
              f"prescient bench-predictor-latency --artifact runs/base-predictor/sida --threads 1; prescient "
              f"bench-tracing --model runs/reference-bench-base --threads 1", costs),
    ))


def caches_page() -> Page:
    def count_only() -> Rows:
        d = load("compare-caches-base.json")
        policies = d["settings"]["policies"]
        runs = {(r["batch_size"], r["capacity_fraction"], r["policy"], r["prefetch"]): r for r in d["runs"]}
        rows = []
        for b in d["settings"]["batch_sizes"]:
            for frac in sorted({r["capacity_fraction"] for r in d["runs"]}):
                if (b, frac, "lru", False) not in runs:
                    continue
                rows.append([b, pct(frac, 0, signed=False), *(num(runs[b, frac, p, False]["hit_rate"], 3) for p in policies),
                             num(runs[b, frac, "mrs", True]["stall_rate"], 3), num(runs[b, frac, "belady", False]["stall_rate"], 3)])
        return ["batch", "capacity", *(f"{p} hit rate" for p in policies), "MRS + SiDA stall rate", "Belady miss rate"], rows

    def simulator() -> Rows:
        d = load("bench-simulator.json")
        return ["policy", "M accesses/s (one core, best of 3)"], [
            [p, num(r["accesses_per_s"] / 1e6, 1)] for p, r in sorted(d["policies"].items(), key=lambda x: -x[1]["accesses_per_s"])]

    timed = "prescient compare-caches --trace runs/base-traces/validation --train-trace runs/base-traces/train " \
            "--predictor {p} --policies {pol} --capacity 0.25,0.5 --batch-size 1 --timing results/bench-runtime-oracle-base.json{x}"
    return Page("caches", "Cache policies and the simulator", """
Counted in hits, prefetching looks like it beats Belady's bound; timed on this machine's link it
costs about what it saves, because a prefetch moves bytes the link could have spent on a demand
miss. What removes loads is keeping the right experts: learned eviction, ranking residents by the
forecast heads' chance of use, closes about half of the gap between LRU and Belady's offline bound
on the simulator's clock, and with perfect forecasts it reaches about twice LRU's speed. The
simulator is fast enough to sweep policies (millions of accesses a second) and, on the runtime
pages, agrees with measured runs.
""", (
        Table("Hit rates, count-only (unlimited link, one layer ahead)", ("compare-caches-base.json",),
              "prescient compare-caches --trace runs/base-traces/validation --predictor runs/base-predictor/sida "
              "--train-trace runs/base-traces/train --policies lru,lfu,fifo,mrs,static,belady --capacity 0.25,0.5 "
              "--batch-size 1,8", count_only),
        Table("Learned eviction on the simulator's clock", ("compare-caches-learned-timed-base.json",),
              timed.format(p="runs/forecast-base/sida-h8", pol="lru,belady,learned,learned-belady", x=""),
              lambda: caches_timed_rows("compare-caches-learned-timed-base.json")),
        Table("Hide-only prefetch", ("compare-caches-learned-hide-base.json",),
              timed.format(p="runs/forecast-base/sida-h8", pol="lru,belady,learned,learned-belady", x=" --hide-only"),
              lambda: caches_timed_rows("compare-caches-learned-hide-base.json")),
        Table("Cross-token prefetch", ("compare-caches-learned-next-base.json",),
              timed.format(p="runs/forecast-base/sida-h8", pol="lru,belady,learned,learned-belady",
                           x=" --layers-ahead all --hide-only --next-token"),
              lambda: caches_timed_rows("compare-caches-learned-next-base.json")),
        Table("How far perfect prediction takes a cache on this link", ("compare-caches-oracle-bound-base.json",),
              timed.format(p="oracle", pol="lru,belady", x=" --layers-ahead all"),
              lambda: caches_timed_rows("compare-caches-oracle-bound-base.json")),
        Table("Our rules on perfect foresight", ("compare-caches-oracle-foresight-base.json",),
              timed.format(p="oracle", pol="lru,learned-belady,belady", x=" --layers-ahead all --hide-only --next-token"),
              lambda: caches_timed_rows("compare-caches-oracle-foresight-base.json")),
        Table("Simulator speed (50 000 synthetic tokens, 8 layers × 64 experts, a quarter cached)", ("bench-simulator.json",),
              f"{W1T} prescient bench-simulator OUT.json --runs 3", simulator),
    ))


def link_rows() -> Rows:
    """`prescient profile-hw --model`: cold random reads of one expert's bytes per queue depth."""
    r = load("link-random-reads.json")["random_reads"]
    rows = [[depth, spread(rate / 1e9, [min(reps) / 1e9, max(reps) / 1e9]), "chosen" if depth == r["depth"] else ""]
            for depth, rate, reps in zip(r["depths"], r["bytes_per_s"], r["repeats"])]
    return ["reads in flight", f"GB/s, median (range), reads of {num(r['expert_bytes'] / 2**20, 2)} MiB", ""], rows


def runtime_page() -> Page:
    runs = "R (G): the run labels of the table, in order. "
    bench = ("prescient bench --model runs/reference-bench --predictors {p} --runs {r} --new-tokens 24 --prompts 3 "
             "--threads 1 --baselines all_resident,accelerate_disk {x}")
    return Page("runtime", "The offloading runtime", """
With half of the bench model's experts in memory and the rest read from disk, loads dominate a
decode step, so what pays is fewer bytes: learned eviction with SiDA-h8's forecasts is about a third
faster than on-demand LRU, while prefetching alone moves about as many bytes as it saves. Perfect
forecasts would double LRU's speed, so the forecasts, not the runtime, are the limit. Every run
generates exactly the plain model's tokens, decodes several times faster than accelerate's disk
offload at a third of the all-resident model's memory, and the time-true simulator predicts its
speed within a few percent. The decode loop's schedulers (the expert pipeline, Klotski's compute-while-loading order; in-token
lookahead after HybriMoE) keep every output exact, bf16 with fewer slots than a layer's routed experts
included, but their speed is not measured on the bench model yet. On a barely trained stand-in the
expert pipeline cuts the stall per token by a sixth (16 against 20 ms at 12.5%, 10 against 11 at
25%, bf16) for tokens/s within the noise, and in-token lookahead from untrained routers evicts more than it saves
(hit rate 0.73 to 0.34 with 8 slots), which is why it is off by default, while a trained probe's
guesses raise the hit rate (0.84 to 0.95 at 25%) for a few more bytes moved, a gain in stall within
this machine's noise, and with 8 slots double the bytes moved for a longer stall. Random reads of one
expert run faster with several in flight than with one. The first three tables were measured
before the expert pipeline existed: their runs are `+serial` runs in today's terms.
""", (
        Table("Sampled decoding, 50% and 25% of the experts in slots", ("bench-runtime-base-sampled.json",),
              bench.format(p="none,freq,corr,oracle,sida=runs/base-predictor/sida,sida8=runs/forecast-base/sida-h8",
                           r="R,R,R", x="--sample 0 --hash-cost off --simulate --link-timing "
                           "results/bench-runtime-oracle-base.json --train-trace runs/base-traces/train"),
              lambda: bench_rows("bench-runtime-base-sampled.json"), note=runs + bench_note("bench-runtime-base-sampled.json")),
        Table("Greedy decoding", ("bench-runtime-base-greedy.json",),
              bench.format(p="none,oracle,sida=runs/base-predictor/sida", r="G,G,G", x="--hash-cost sida"),
              lambda: bench_rows("bench-runtime-base-greedy.json"), note=runs + bench_note("bench-runtime-base-greedy.json")),
        Table("Learned eviction with forecasts and with perfect forecasts", ("bench-runtime-oracle-base.json",),
              bench.format(p="none,oracle,sida8=runs/forecast-base/sida-h8", r="R,R,R",
                           x="--sample 0 --hash-cost off --simulate"),
              lambda: bench_rows("bench-runtime-oracle-base.json"), note=runs + bench_note("bench-runtime-oracle-base.json")),
        Table("The decode loop's schedulers: expert pipeline on (base), off (+serial), with in-token lookahead (+look)",
              ("bench-schedulers-short-wide.json",),
              "prescient bench-compressed --models bf16=runs/short-wide-w16,int4=runs/short-wide-w4 --packed int4 "
              "--dtype bfloat16 --budgets 12.5%,25% --modes base,serial,look --repeats 3 --new-tokens 16 --prompts 2",
              lambda: compressed_rows("bench-schedulers-short-wide.json"),
              note="Not the bench model: `runs/short-wide` is the tiny recipe trained 40 steps (runs/tiny-short.yaml) "
                   "with experts widened to 4 096, 4 layers x 16 experts; bf16 and int4 (RTN, group 128) copies by "
                   "`prescient quantize`; at 12.5% of the bf16 bytes int4 holds 47% of the experts and this model's "
                   "skewed routing hits 99% of them, so its rows say little about the bench model. Other jobs shared "
                   "the machine (load average 3-5): read stall, MB/token and hit rate before tokens/s."),
        Table("Quality of the stand-in's int4 copy (packed slots, teacher-forced, 16 windows per corpus)",
              ("short-wide-quality-w4-packed.json",),
              "prescient quality --model runs/short-wide-w4 --reference runs/short-wide --dataset stdlib-code,stdlib-docs "
              "--windows 16 --dtype bfloat16 --slot-format packed",
              lambda: quality_rows(["short-wide-quality-w4-packed.json"])),
        Table("In-token lookahead guessed by the trained probe (+look), bf16, the same stand-in",
              ("bench-lookahead-probe-short-wide.json",),
              "prescient bench --model runs/short-wide-w16 --dtype bfloat16 --lookahead-probe runs/probe-short/probe "
              "--runs R,R,R --baselines all_resident --sample 0 --new-tokens 16 --prompts 2 --threads 1 --hash-cost off",
              lambda: bench_rows("bench-lookahead-probe-short-wide.json"),
              note=runs + "The probe of the predictors page (trained on `runs/short`, whose widening this is). "
                   "Other jobs shared the machine (load average 3-5)."),
        Table("The link as a miss uses it: cold random reads of one expert", ("link-random-reads.json",),
              "prescient profile-hw --model runs/link-probe/mixtral-2mb --repeats 9 --reads 64", link_rows,
              note="A Mixtral of 2.36 MB float32 experts built with save_tiny_model; page cache dropped before "
                   "each timed run and after each read; load average about 10 on 2 cores during the run."),
    ))


def quantize_rows() -> Rows:
    """`prescient quantize`: each written checkpoint, its experts' bytes, time and peak memory."""
    names = sorted(p.name for p in RESULTS.glob("quantize-*.json"))
    rows = []
    for name in names:
        q = load(name)
        rows.append([f"`{name}`", f"`{q['source']}`", q["bits"], q["method"] or "–",
                     q["group_size"] or ("–" if q["bits"] == 16 else "channel"), num(q["expert_bytes"] / 2**20, 1), num(q["expert_compression"]), num(q["seconds"], 1),
                     num(q["peak_rss_bytes"] / 2**30, 2)])
    return ["JSON", "source", "bits", "method", "group", "experts (MiB)", "× smaller than float32", "seconds",
            "peak RSS (GiB)"], rows


def hqq_rows() -> Rows:
    """The HQQ probe: weight error and quality of each method's copy, group 64."""
    rows = []
    for name in ("hqq-probe-base-w4g64.json", "hqq-probe-base-w2g64.json"):
        d = load(name)
        for method, r in d["methods"].items():
            rows.append([f"int{d['bits']} {method}, group {d['group_size']}", num(r["relative_frobenius_error"], 3),
                         *quality_cells(f"quality-base-{method}-w{d['bits']}g{d['group_size']}.json")[:2]])
    return ["experts", "relative weight error", "perplexity change code / docs", "KL code / docs"], rows


def miss_time_rows() -> Rows:
    """Where a miss's time goes, per expert matrix: expanding, arranging for the kernel, computing."""
    d = load("expert-kernels-bench.json")
    rows = []
    for matrix, m in d["matrices"].items():
        for fmt in ("int4", "int8"):
            if fmt in m:
                f = m[fmt]
                rows.append([f"`{matrix}` {m['shape']}", fmt, num(f["expand_fp32_ms"], 3), num(f["expand_bf16_ms"], 3),
                             num(f["repack_ms"], 3), num(f["kernel_ms"], 3), num(m["bf16_linear_ms"], 3),
                             num(m["fp32_linear_ms"], 3)])
    return ["matrix", "stored", "expand to fp32 ms", "expand to bf16 ms", "arrange for the kernel ms", "kernel ms",
            "bf16 linear ms", "fp32 linear ms"], rows


def transfer_worker_rows() -> Rows:
    """One or two transfer workers against bf16 all-resident: tokens/s per repeat and the median."""
    rows = []
    for config in ("w1", "w2", "bf16"):
        per: dict[str, list[float]] = {}
        for r in (1, 2, 3):
            d = load(f"bench-transfer-workers-int4-packed/{config}-r{r}.json")
            for run in [*d["baselines"].values(), *d["runs"]]:
                per.setdefault(run["label"], []).append(run["tokens_per_s"])
        for label, v in per.items():
            rows.append([config, f"`{label}`", ", ".join(num(x) for x in v), num(median(v))])
    return ["bench", "run", "tokens/s per repeat", "median"], rows


def compressed_page() -> Page:
    bc = ("prescient bench-compressed --models {m} --budgets {b} --repeats 3 --dtype {d} --sample 0 --threads 1 "
          "--quality ... --json ... --plot ...{x}")
    mixed = bc.format(m="bf16=runs/bench-w16,int4-packed=runs/bench-w4,int8c-packed=runs/bench-w8c", b="12.5%",
                      d="bfloat16", x=" --packed int4-packed,int8c-packed --mixed mix-forecast=int4-packed+int8c-packed:forecast,"
                      "mix-router=...:router,mix-hotness=...:hotness --predictor sida8=runs/forecast-base/sida-h8 "
                      "--policy learned-belady{s}")
    gptq = bc.format(m="bf16=runs/bench-w16,int4-packed=runs/bench-w4-gptq,int2-packed=runs/bench-w2-gptq", b="{b}",
                     d="bfloat16", x=" --packed int4-packed,int2-packed{mx} --predictor sida8=runs/forecast-base/sida-h8 "
                     "--policy learned-belady")
    quality_names = sorted(p.name for p in RESULTS.glob("quality-*.json"))
    tables = [
        Table("Writing compressed checkpoints", tuple(sorted(p.name for p in RESULTS.glob("quantize-*.json"))),
              "prescient quantize --model SRC --bits B [--group-size G|channel] [--method gptq] --out DIR", quantize_rows),
        Table("Quality, float32 and bf16, teacher-forced (64 windows of 256 tokens per corpus)",
              tuple(n for n in quality_names if n.startswith("quality-base-")),
              "prescient quality --model runs/base-X --reference runs/reference-bench-base --windows 64 "
              "[--dtype bfloat16 [--slot-format packed]] --json ...",
              lambda: quality_rows([n for n in quality_names if n.startswith("quality-base-")])),
        Table("Quality in decode mode through the runtime, 12.5% of the bf16 experts' bytes",
              tuple(n for n in quality_names if not n.startswith("quality-base-")),
              "prescient quality --model runs/base-w4 --reference runs/reference-bench-base --windows 8|32 --dtype "
              "bfloat16 --slot-format packed --budget 7077888B --predictor runs/forecast-base/sida-h8 --policy "
              "learned-belady --decode [--fine-model runs/base-w8c --fine-share S --precision-rule R]",
              lambda: quality_rows([n for n in quality_names if not n.startswith("quality-base-")])),
        Table("HQQ probed before building it (group 64)",
              ("hqq-probe-base-w4g64.json", "hqq-probe-base-w2g64.json"),
              "python -m experiments.hqq_probe --model runs/reference-bench-base --bits B --group-size 64 --out "
              "runs/hqq-probe --json ...; then prescient quality on each copy", hqq_rows),
        Table("Where a miss's time goes, per matrix", ("expert-kernels-bench.json",),
              "python -m experiments.bench_expert_kernels --model runs/reference-bench --json ...", miss_time_rows),
    ]
    benches = [
        ("bench-compressed.json", "float32 compute, expanded slots, on-demand LRU",
         bc.format(m="fp32=runs/reference-bench,bf16=runs/bench-w16,int8=runs/bench-w8,int4=runs/bench-w4",
                   b="12.5%,25%,50%", d="float32", x="")),
        ("bench-compressed-bf16.json", "bf16 compute, expanded and packed slots",
         bc.format(m="bf16=...,int8=...,int4=...,int8c-packed=runs/bench-w8c,int4-packed=runs/bench-w4", b="12.5%,25%,50%",
                   d="bfloat16", x=" --packed int8c-packed,int4-packed --predictor sida=runs/base-predictor/sida --policy mrs")),
        ("bench-compressed-learned.json", "int4 packed with learned eviction",
         bc.format(m="bf16=runs/bench-w16,int4-packed=runs/bench-w4", b="12.5%,25%", d="bfloat16",
                   x=" --packed int4-packed --predictor sida8=runs/forecast-base/sida-h8 --policy learned-belady")),
        ("bench-compressed-mixed-first-run.json", "mixed precision, share 0.25, first run", mixed.format(s="")),
        ("bench-compressed-mixed10-first-run.json", "mixed precision, share 0.1, first run", mixed.format(s=" --fine-share 0.1")),
        ("bench-compressed-mixed.json", "mixed precision, share 0.25", mixed.format(s="")),
        ("bench-compressed-mixed10.json", "mixed precision, share 0.1", mixed.format(s=" --fine-share 0.1")),
        ("bench-compressed-int2-first-run.json", "2-bit experts and mixed 2/4 bits, first run",
         gptq.format(b="12.5%", mx=" --mixed mix-forecast=int2-packed+int4-packed:forecast,...")),
        ("bench-compressed-int2.json", "2-bit experts and mixed 2/4 bits",
         gptq.format(b="12.5%", mx=" --mixed mix-forecast=int2-packed+int4-packed:forecast,...")),
        ("bench-compressed-miss-path.json", "a cheaper miss: GPTQ int4 and int2 packed", gptq.format(b="12.5%,25%", mx="")),
        ("bench-compressed-mixed10-miss-path.json", "mixed precision, share 0.1, cheaper miss", mixed.format(s=" --fine-share 0.1")),
        ("bench-compressed-mixed-miss-path.json", "mixed precision, share 0.25, cheaper miss", mixed.format(s="")),
    ]
    tables += [Table(f"Decode speed: {title}", (name,), cmd, lambda name=name: compressed_rows(name)) for name, title, cmd in benches]
    tables += [
        Table("int4 packed through `prescient bench`, 113 and 56 slots", ("bench-runtime-packed-int4.json",),
              "prescient bench --model runs/bench-w4 --dtype bfloat16 --slot-format packed --predictors "
              "none,sida=runs/base-predictor/sida --runs R,R,R --sample 0 --new-tokens 24 --prompts 3 --threads 1 "
              "--baselines all_resident --hash-cost off", lambda: bench_rows("bench-runtime-packed-int4.json")),
        Table("One or two transfer workers, int4 packed at 25%, interleaved with bf16 all-resident",
              tuple(f"bench-transfer-workers-int4-packed/{c}-r{r}.json" for c in ("w1", "w2", "bf16") for r in (1, 2, 3)),
              "results/bench-transfer-workers-int4-packed/run.sh", transfer_worker_rows),
    ]
    return Page("compressed", "Compressed experts", """
Compression pays in this project because it changes how many experts fit, not only what a miss
costs. Stored int4 and computed from packed int4 slots, the experts at a quarter of their bf16
bytes (which hold 88% of the int4 experts) decode at least as fast as the whole bf16 model in memory, for a few tenths of a percent of
perplexity (less with GPTQ); below that budget 2-bit GPTQ experts trade a few percent of perplexity
for about a third more speed. Expanded slots (a compressed expert widened back into bf16 or float32)
only make a miss cheaper and gain far less. Mixed precision chosen per load, by router weight or by
forecast, removes a tenth to a fifth of int4's next-token KL but costs speed, and no measurement
here resolves a perplexity gain from it.
""", tuple(tables))


def serving_page() -> Page:
    cmd = ("{W1T} prescient bench-serve --model runs/reference-bench --predictors {p} --policy lru --budget {b} --clients "
           "1,4,16,64 --repeats 3 --max-tokens 32 --json ... --plot ...")
    return Page("serving", "Serving under load", f"""
The server answers every request under concurrent streaming load (none refused, lost or hung) and
batching requests together raises throughput with the number of clients. On two CPU cores the
gain at 16 clients stays near 2× even with every expert resident: each expert is a memory-bound
FFN, and a batch of sampled sequences touches most experts per step, so batching only pays once a
step covers nearly every expert for many tokens. SiDA's prefetching adds a few percent at every load.
""", (
        Table("Half of the experts in slots", ("bench-serve-base.json",),
              cmd.format(p="none,sida=runs/base-predictor/sida", b="0.5", W1T=W1T), lambda: serve_rows("bench-serve-base.json")),
        Table("Every expert resident (nothing loaded after the warm-up)", ("bench-serve-resident-base.json",),
              cmd.format(p="none", b="1.0", W1T=W1T), lambda: serve_rows("bench-serve-resident-base.json")),
    ))


KLOTSKI = "bench-batch-bb-wide.json"  # the batch schedules compared on the bench-size stand-in


def cgopipe_rows() -> Rows:
    """CGOPipe against the same runtime without overlap, per policy, and the all-resident run."""
    d = load("bench-batch.json")
    by: dict[str, dict[str, dict]] = {}
    for r in d["runs"]:
        by.setdefault(r["label"], {})[r["mode"]] = r
    rows = []
    for label, m in by.items():
        c, s = m.get("cgopipe"), m.get("sequential")
        rows.append([label, num(c["tokens_per_s"]), num(c["predicted_tokens_per_s"]),
                     num(s["tokens_per_s"]) if s else "–", num(c["tokens_per_s"] / s["tokens_per_s"]) if s else "–",
                     f"{num(c['bytes_moved'] / 2**30, 1)} / {num(s['bytes_moved'] / 2**30, 1)}" if s else num(c["bytes_moved"] / 2**30, 1),
                     f"{num(c['stall_seconds'], 1)} / {num(s['stall_seconds'], 1)}" if s else num(c["stall_seconds"], 1)])
    rows.append(["all resident, plain batched `generate` (N=64)", num(d["resident_tokens_per_s"]), "", "", "", "", ""])
    return ["policy", "CGOPipe tokens/s", "HRM prediction", "sequential tokens/s", "ratio",
            "GiB moved, CGOPipe / sequential", "stall s, CGOPipe / sequential"], rows


def hrm_rows() -> Rows:
    """The HRM's ranking and planner choice against the measured grid."""
    d = load("bench-batch.json")
    return ["measure", "value"], [["policies measured", d["grid_size"]],
                                  ["Spearman, predicted against measured CGOPipe tokens/s", num(d["spearman"], 3)],
                                  ["planner's choice / best measured", f"{d['planner_choice']} / {d['best_measured']}"],
                                  ["planner's choice below the best measured", pct(d["planner_gap"], 1, signed=False)],
                                  ["every output equal to the request generated alone", "yes" if d["all_exact"] else "no"]]


def plan_rows() -> Rows:
    """`prescient plan` in the paper's setting: the policy chosen and its predicted speed."""
    d = load("plan-mixtral-8x7b-t4.json")
    p = d["policy"]
    return ["hardware", "model", "N", "μ", "attention on", "FFN on", "r_w", "r_c", "predicted tokens/s",
            "decode only", "bottleneck"], [[
        d["hardware"]["name"], d["model"]["config"], p["n_requests"], p["micro_batch"], p["attention_on"], p["ffn_on"],
        p["r_w"], p["r_c"], num(d["tokens_per_s"], 1), num(d["decode_tokens_per_s"], 1), d["decode_step"]["bottleneck"]]]


def profile_rows() -> Rows:
    """This machine as `prescient profile-hw` measured it."""
    d = load("hw-profile-this-machine.json")
    return ["profile", "CPU GFLOP/s", "memory GB/s", "disk → CPU GB/s", "notes"], [[
        d["name"], num(d["cpu"]["peak_flops"] / 1e9, 1), num(d["cpu"]["memory_bandwidth"] / 1e9, 1),
        num(d["disk_to_cpu"] / 1e9, 2), d["notes"]]]


def klotski_rows() -> Rows:
    """The batch schedules at one budget, per policy: tokens/s, ratios, bytes and the HRM's predictions."""
    d = load(KLOTSKI)
    policies = d["by_policy"].values()
    # results from before the accelerate baseline and the HRM's per-schedule predictions lack these
    accelerate = any("accelerate" in p["modes"] for p in policies)
    predicted = any("prediction_over_measured" in m for p in policies for m in p["modes"].values())
    modes = ("klotski", "klotski-paper", "cgopipe", "zigzag") + (("accelerate",) if accelerate else ())
    short = {"klotski": "K", "klotski-paper": "Kp", "cgopipe": "C", "zigzag": "Z", "sequential": "S",
             "accelerate": "A"}
    rows = []
    for label, policy in d["by_policy"].items():
        m = policy["modes"]
        mb = lambda mode: num(m[mode]["decode_bytes_per_token"]["median"] / 1e6, 1) if mode in m else "–"
        row = [label, *(spread(m[mode]["tokens_per_s"]["median"], [m[mode]["tokens_per_s"]["min"],
                                                                   m[mode]["tokens_per_s"]["max"]])
                        if mode in m else "–" for mode in modes),
               num(policy["klotski_over_cgopipe"]), num(policy["cgopipe_over_zigzag"])]
        if accelerate:
            row.append(num(policy["cgopipe_over_accelerate"]) if "cgopipe_over_accelerate" in policy else "–")
        row += [" / ".join(mb(mode) for mode in ("klotski", "cgopipe", "zigzag") + (("accelerate",) if accelerate
                                                                                  else ())),
                pct(m["klotski"]["activated_share"], 0, signed=False)]
        if predicted:
            row.append(", ".join(f"{short.get(mode, mode)} {num(s['prediction_over_measured']['tokens_per_s'])}"
                                 for mode, s in m.items() if "prediction_over_measured" in s))
        rows.append(row)
    head = ["policy", "Klotski tokens/s", "Klotski, paper's hot timing", "CGOPipe", "FlexGen zig-zag"]
    head += ["accelerate (disk offload)"] if accelerate else []
    head += ["Klotski / CGOPipe", "CGOPipe / zig-zag"] + (["CGOPipe / accelerate"] if accelerate else [])
    head += ["decode MB/token K / C / Z" + (" / A" if accelerate else ""), "experts a step activates"]
    head += ["HRM predicted / measured tokens/s"] if predicted else []
    return head, rows


def klotski_planner_rows() -> Rows:
    """Klotski's planner against the sweep of group sizes."""
    sweep = load(KLOTSKI)["klotski_sweep"]
    rows = [[n, spread(v["median"], [v["min"], v["max"]])] for n, v in sweep["tokens_per_s_by_group_size"].items()]
    rows.append(["planner's n / best measured n", f"{sweep['planner_group_size']} / {sweep['best_group_size']}"])
    rows.append(["planner's n below the best measured", pct(sweep["planner_gap"], 1, signed=False)])
    return ["group size n", "Klotski tokens/s median (range)"], rows


def kernel_rows(name: str) -> Rows:
    """`prescient bench-kernels`: each kernel arm against the model's own, per policy."""
    d = load(name)
    arms = [a for a in d["settings"]["arms"] if a != "model"]
    out = []
    for label, policy in d["summary"]["by_policy"].items():
        m = policy["arms"]
        cell = lambda arm, key="tokens_per_s": spread(m[arm][key]["median"], [m[arm][key]["min"], m[arm][key]["max"]])
        row = [label, cell("model")]
        for arm in arms:
            ratio = policy[f"{arm}_over_model"]
            row += [cell(arm), spread(ratio["tokens_per_s"]["ratio_of_medians"],
                                      [ratio["tokens_per_s"]["paired"]["min"], ratio["tokens_per_s"]["paired"]["max"]]),
                    num(ratio["decode_tokens_per_s"]["ratio_of_medians"])]
        out.append(row + ["yes" if policy["exact"] else "no"])
    head = ["policy", "model's kernel tokens/s"]
    for arm in arms:
        head += [f"{arm} tokens/s", f"{arm} / model (paired range)", f"{arm} / model, decode"]
    return head + ["every output exact"], out


def crossover_rows(name: str) -> Rows:
    """The crossover the auto kernel chose: seconds per kernel at each load of tokens per expert."""
    c = load(name)["crossover"]
    kernels = list(c["seconds"])
    body = [[load_, kernel, *(num(c["seconds"][k][i] * 1e3, 1) if c["seconds"][k][i] is not None else "–"
                              for k in kernels), "yes" if load_ >= c["pipeline_from"] else "no"]
            for i, (load_, kernel) in enumerate(zip(c["loads"], c["kernels"]))]
    return ["tokens per expert", "kernel chosen", *(f"{k} ms" for k in kernels), "pipelined"], body


def batch_page() -> Page:
    return Page("batch", "Batch decoding and the planner", """
At one memory budget and with prefill counted, Klotski's batch groups move an expert once per group
and only the experts the group activates, so where a decode step activates about half of a layer's
experts (8 and 16 requests here) Klotski decodes several times faster than CGOPipe and FlexGen's
zig-zag schedule, which stream every non-resident expert each step; at 64 requests, where a step
activates most experts, the schedules come within noise of each other. Klotski and CGOPipe beat
accelerate's own disk offload by 2.5x or more. On this CPU-only machine CGOPipe gains nothing over
the zig-zag schedule, since attention, expert compute and the reads share the same two cores. The
HRM ranks schedules and policies roughly (Spearman about 0.8) but misjudges absolute speed by up to
4x: use it to rank, not to promise tokens/s. EPS-MoE's load-aware kernel choice changes little here:
transformers' default for these experts is already grouped_mm, the crossover keeps it at decode loads,
and the gains are within this machine's spread. The older table against the same runtime without
overlap (the strawman the papers do not use) is kept for the record.
""", (
        Table("CGOPipe against the same runtime without overlap", ("bench-batch.json",),
              "prescient bench-batch --model runs/reference-bench --json results/bench-batch.json --plot "
              "results/bench-batch.png --trace runs/base-traces/train", cgopipe_rows),
        Table("The HRM against measurements", ("bench-batch.json",), "the same `prescient bench-batch` run", hrm_rows),
        Table("Klotski, CGOPipe, FlexGen's zig-zag and accelerate at one budget, prefill counted", (KLOTSKI,),
              "prescient bench-batch --model runs/bb-wide --json results/bench-batch-bb-wide.json --plot "
              "results/bench-batch-bb-wide.png --trace runs/bb-traces/train --policy 64:16:0.5 --compare "
              "8:4:0.5,16:4:0.5 --grid none --repeats 3 --sweep-groups 1,2,4,8,16 --accelerate repeats", klotski_rows,
              note="Not the bench model: `runs/bb-wide` has the bench model's shapes (8 layers of 16 experts, top-2, "
                   "experts widened to 7 424: 2.2 GB of experts) but its base was trained 250 steps instead of 2 200 "
                   "(`runs/bb.yaml`, the base recipe shortened; validation loss 5.24 on stdlib-code). Three "
                   "interleaved repeats, page cache dropped before every run, the machine otherwise idle. An earlier "
                   "run of the same command (killed by the memory leak fixed since, two repeats, not kept) measured "
                   "CGOPipe about twice as fast at N=8 and 16 (17.0 and 19.7 tokens/s, Klotski 19.7 and 36.2): the "
                   "ordering held, the ratios did not, and why the stream ran slower here is not understood."),
        Table("Klotski's planner against a sweep of group sizes", (KLOTSKI,),
              "the same `prescient bench-batch` run", klotski_planner_rows),
        Table("Load-aware expert kernels (EPS-MoE) against the model's own, in Klotski's decoder",
              ("bench-kernels-bb-wide.json",),
              "prescient bench-kernels --model runs/bb-wide --json results/bench-kernels-bb-wide.json --trace "
              "runs/bb-traces/train --policies 8:4:0.5,16:4:0.5,64:16:0.5 --arms model,auto --repeats 3",
              lambda: kernel_rows("bench-kernels-bb-wide.json"),
              note="The bench-size stand-in `runs/bb-wide` (as above), the machine otherwise idle. Logits of both arms "
                   "bit-equal to the plain model's (one forward over 64 prompts, one greedy generation)."),
        Table("The crossover the auto kernel uses (this machine, the stand-in's layer shape, random weights)",
              ("bench-kernels-bb-wide.json",), "the same `prescient bench-kernels` run",
              lambda: crossover_rows("bench-kernels-bb-wide.json")),
        Table("The same on the smaller stand-in, under load", ("bench-kernels-kb-wide.json",),
              "prescient bench-kernels --model runs/kb-wide --json results/bench-kernels-kb-wide.json --trace "
              "runs/kb-traces/train --policies 8:4:0.5,16:4:0.5,64:16:0.5 --arms model,auto,auto-pipelined --repeats 3",
              lambda: kernel_rows("bench-kernels-kb-wide.json"),
              note="`runs/kb-wide` (the tiny recipe's shapes, 4 layers, trained 300 steps, experts widened to 8 192); a "
                   "training job shared the two cores (load average about 4.4). Its crossover kept grouped_mm to 8 "
                   "tokens per expert and eager from 16, so the gain at N=64 is the prefill's; auto-pipelined is the "
                   "same configuration as auto there (the pipeline paid at every load): the gap between the two is noise."),
        Table("The HRM in the paper's setting (Mixtral 8x7B on a T4, 192 GB of CPU memory)", ("plan-mixtral-8x7b-t4.json",),
              "prescient plan --hardware t4 --model configs/models/mixtral-8x7b --prompt-len 242 --gen-len 50 "
              "--cpu-memory 192GiB --json ...", plan_rows,
              note="MoE-Lightning reports 26.3 tokens/s in this setting and FlexGen 22.7; the presets hold "
                   "data-sheet peaks, so the prediction is an upper bound."),
        Table("This machine as `prescient profile-hw` measured it", ("hw-profile-this-machine.json",),
              "prescient profile-hw --json results/hw-profile-this-machine.json", profile_rows),
    ))


def archs_page() -> Page:
    def rows() -> Rows:
        d = load("archs.json")
        esc = lambda s: str(s).replace("|", "\\|")  # noqa: E731
        return ["family", "offloaded generation", "detail", "trace, train, evaluate, serve SiDA", "CGOPipe"], [
            [f"`{r['family']}`", r["status"], esc(r["detail"]), esc(r.get("pipeline") or "—"), esc(r.get("cgopipe") or "—")]
            for r in d["rows"]]

    d = load("archs.json")
    return Page("architectures", "Supported architectures", f"""
Every MoE architecture of the installed transformers ({d['transformers']}) is built tiny and checked:
offloaded generation must give the plain model's greedy tokens, or the family is refused in one line
with the reason. Conclude that offloading, tracing and SiDA serving work for nearly every MoE
family transformers ships, and that CGOPipe batch decoding is narrower: it drives only decoder-only
models built like Mixtral. {d['summary']}
""", (Table("Every MoE family", ("archs.json",), f"{d['command']} --markdown --json results/archs.json", rows),))


PAGES: tuple[Page, ...] = (reference_pages(), demo_page(), predictors_page(), caches_page(), runtime_page(),
                           compressed_page(), serving_page(), batch_page(), archs_page())


def _bench(name: str, label: str) -> float:
    return load(name)["ratios"][label]["tokens_per_s"]


def _summary(name: str, model: str, label: str) -> float:
    return load(name)["summary"][model][label]["tokens_per_s"]


def _ppl(name: str) -> str:
    d = load(name)["datasets"]
    return f"{pct(d[CODE]['perplexity_increase'])} / {pct(d[DOCS]['perplexity_increase'])}"


SAMPLED, MISS = "bench-runtime-base-sampled.json", "bench-compressed-miss-path.json"
HEADLINES: tuple[Headline, ...] = (
    Headline("SiDA's hash function: recall@k of the current token's experts (token table beside it)",
             lambda: f"{num(load('evaluate-base.json')['predictors']['sida']['recall_at_k'], 3)} "
                     f"({num(load('evaluate-base.json')['predictors']['token']['recall_at_k'], 3)})",
             "predictors", "evaluate-base.json"),
    Headline("Learned eviction (SiDA-h8 forecasts) against on-demand LRU, half the experts in memory, measured",
             lambda: f"{num(_bench(SAMPLED, 'sida8+learned-belady@0.5') / _bench(SAMPLED, 'none+lru@0.5'))}×",
             "runtime", SAMPLED),
    Headline("The same with perfect forecasts (the limit is the forecasts)",
             lambda: f"{num(_bench('bench-runtime-oracle-base.json', 'oracle+learned-belady@0.5') / _bench('bench-runtime-oracle-base.json', 'none+lru@0.5'))}×",
             "runtime", "bench-runtime-oracle-base.json"),
    Headline("Offloaded LRU at 50% against accelerate's disk offload",
             lambda: f"{num(_bench(SAMPLED, 'none+lru@0.5') / load(SAMPLED)['baselines']['accelerate_disk']['tokens_per_s'], 1)}×",
             "runtime", SAMPLED),
    Headline("Time-true simulator against the runtime: Spearman, median relative error",
             lambda: f"{num(load(SAMPLED)['simulator']['agreement']['spearman'], 3)}, "
                     f"{pct(load(SAMPLED)['simulator']['agreement']['median_relative_error'], 1, signed=False)}",
             "runtime", SAMPLED),
    Headline(f"int4 packed experts in 25% of the bf16 experts' bytes (which hold "
             f"{load(MISS)['summary']['int4-packed']['none+lru@0.25']['budget']:.0%} of the int4 experts), bf16 compute, "
             "against the whole bf16 model in memory, tokens/s",
             lambda: f"{num(_summary(MISS, 'int4-packed', 'none+lru@0.25'))} against {num(_summary(MISS, 'bf16', 'all_resident'))}",
             "compressed", MISS),
    Headline("int4 GPTQ experts: perplexity change, stdlib-code / stdlib-docs",
             lambda: _ppl("quality-base-w4-gptq.json"), "compressed", "quality-base-w4-gptq.json"),
    Headline("Serving: 16 concurrent streaming clients against one, tokens/s (SiDA + LRU, half the experts, page cache kept)",
             lambda: f"{num(load('bench-serve-base.json')['summary']['sida']['16']['speedup_over_1_client_median'])}×",
             "serving", "bench-serve-base.json"),
    Headline("Klotski's batch groups against CGOPipe at one budget, 8 / 16 / 64 requests, prefill counted (bench-size stand-in)",
             lambda: " / ".join(f"{num(load(KLOTSKI)['by_policy'][label]['klotski_over_cgopipe'])}×"
                                for label in ("N=8 μ=4 r_w=0.5", "N=16 μ=4 r_w=0.5", "N=64 μ=16 r_w=0.5")),
             "batch", KLOTSKI),
    Headline("MoE architectures of transformers offloaded exactly",
             lambda: (lambda rows: f"{sum(r['status'] == 'exact' for r in rows)} of {len(rows)}")(load("archs.json")["rows"]),
             "architectures", "archs.json"),
)
