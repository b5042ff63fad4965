"""The results page `compressed`: size, quality and speed of int8, int4 and int2 experts, and mixed precision."""

from __future__ import annotations

from statistics import median

from experiments.report_pages.rows import CODE, DOCS, bench_rows, compressed_rows, quality_cells, quality_rows
from experiments.report_tables import RESULTS, Headline, Page, Rows, Table, load, num, pct


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


def page() -> Page:
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
        Table("One or two transfer workers, int4 packed at 25%, interleaved with bf16 all-resident (measured before "
              "the cheaper miss; the miss-path table above measures the same configuration since)",
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


def _summary(name: str, model: str, label: str) -> float:
    return load(name)["summary"][model][label]["tokens_per_s"]


def _ppl(name: str) -> str:
    d = load(name)["datasets"]
    return f"{pct(d[CODE]['perplexity_increase'])} / {pct(d[DOCS]['perplexity_increase'])}"


MISS = "bench-compressed-miss-path.json"
HEADLINES: tuple[Headline, ...] = (
    Headline(f"int4 packed experts in 25% of the bf16 experts' bytes (which hold "
             f"{load(MISS)['summary']['int4-packed']['none+lru@0.25']['budget']:.0%} of the int4 experts), bf16 compute, "
             "against the whole bf16 model in memory, tokens/s",
             lambda: f"{num(_summary(MISS, 'int4-packed', 'none+lru@0.25'))} against {num(_summary(MISS, 'bf16', 'all_resident'))}",
             "compressed", MISS),
    Headline("int4 GPTQ experts: perplexity change, stdlib-code / stdlib-docs",
             lambda: _ppl("quality-base-w4-gptq.json"), "compressed", "quality-base-w4-gptq.json"),
)
