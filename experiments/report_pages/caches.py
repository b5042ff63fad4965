"""The results page `caches`: cache policies counted and timed, learned eviction, the bounds, the simulator's speed."""

from __future__ import annotations

from experiments.report_pages.rows import W1T, caches_timed_rows
from experiments.report_tables import Page, Rows, Table, load, num, pct


def page() -> Page:
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
    sida8, learned = "runs/forecast-base/sida-h8", "lru,belady,learned,learned-belady"
    next_token = " --layers-ahead all --hide-only --next-token"
    timed_runs = (  # title, JSON, predictor, policies, further flags
        ("Learned eviction on the simulator's clock", "compare-caches-learned-timed-base.json", sida8, learned, ""),
        ("Hide-only prefetch", "compare-caches-learned-hide-base.json", sida8, learned, " --hide-only"),
        ("Cross-token prefetch", "compare-caches-learned-next-base.json", sida8, learned, next_token),
        ("How far perfect prediction takes a cache on this link", "compare-caches-oracle-bound-base.json", "oracle",
         "lru,belady", " --layers-ahead all"),
        ("Our rules on perfect foresight", "compare-caches-oracle-foresight-base.json", "oracle",
         "lru,learned-belady,belady", next_token),
    )
    timed_tables = [Table(title, (name,), timed.format(p=predictor, pol=policies, x=flags),
                          lambda name=name: caches_timed_rows(name))
                    for title, name, predictor, policies, flags in timed_runs]
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
        *timed_tables,
        Table("Simulator speed (50 000 synthetic tokens, 8 layers × 64 experts, a quarter cached)", ("bench-simulator.json",),
              f"{W1T} prescient bench-simulator OUT.json --runs 3", simulator),
    ))
