"""Row builders that several results pages share: the `prescient quality`, `prescient bench`,
`prescient bench-compressed`, `prescient compare-caches` and `prescient evaluate` JSONs as table rows."""

from __future__ import annotations

from statistics import median

from experiments.report_tables import Rows, load, num, pct, spread


CODE, DOCS = "stdlib-code", "stdlib-docs"
W1T = "OMP_NUM_THREADS=1"


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
