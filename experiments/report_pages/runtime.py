"""The results page `runtime`: the offloading runtime's measured decode speed, memory and the simulator's
agreement."""

from __future__ import annotations

from functools import partial
from statistics import median

from experiments.report_pages.memory import systems_rows
from experiments.report_pages.rows import bench_rows, compressed_rows, quality_rows
from experiments.report_tables import Headline, Page, Rows, Table, load, num, pct, spread


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


def link_rows() -> Rows:
    """`prescient profile-hw --model`: cold random reads of one expert's bytes per queue depth."""
    r = load("link-random-reads.json")["random_reads"]
    rows = [[depth, spread(rate / 1e9, [min(reps) / 1e9, max(reps) / 1e9]), "chosen" if depth == r["depth"] else ""]
            for depth, rate, reps in zip(r["depths"], r["bytes_per_s"], r["repeats"])]
    return ["reads in flight", f"GB/s, median (range), reads of {num(r['expert_bytes'] / 2**20, 2)} MiB", ""], rows


def decode_kernel_rows(name: str) -> Rows:
    """Per thread count and expert kernel: decode tokens/s and the experts' GB/s (median, range),
    beside the machine's measured read bandwidth, the ms a token spends outside the experts where
    measured, and whether the tokens and logits equal the model's."""
    result = load(name)
    overhead = any("outside_experts_ms_per_token" in m for kernels in result["summary"].values() for m in kernels.values())
    rows = []
    for threads, kernels in result["summary"].items():
        bus = result["bus"][threads.split()[0]]["read_gb_s"]
        for kernel, m in kernels.items():
            speed, rate, rest = m["decode_tokens_per_s"], m.get("experts_gb_s"), m.get("outside_experts_ms_per_token")
            rows.append([threads, kernel, spread(speed["median"], [speed["min"], speed["max"]], 1),
                         spread(rate["median"], [rate["min"], rate["max"]], 1) if rate else "–", num(bus, 1),
                         *([spread(rest["median"], [rest["min"], rest["max"]], 2) if rest else "–"] if overhead else []),
                         _against(result["exactness"].get(kernel))])
    return ["threads", "expert kernel", "decode tokens/s", "experts GB/s", "bus read GB/s",
            *(["ms a token outside the experts"] if overhead else []), "against the model's own"], rows


def llama_note(name: str) -> str:
    """The default kernel's median decode over llama.cpp's, and over transformers' kernel, per thread count."""
    summary = load(name)["summary"]
    parts = [f"{threads}: gemv {num(m['gemv']['decode_tokens_per_s']['median'] / m['llama.cpp']['decode_tokens_per_s']['median'])}"
             f"x llama.cpp, {num(m['gemv']['decode_tokens_per_s']['median'] / m['model']['decode_tokens_per_s']['median'])}"
             "x transformers' kernel" for threads, m in summary.items()]
    return "Medians: " + "; ".join(parts) + "."


def llama_memory_note(name: str) -> str:
    """Per cap of a `bench --memory` run with llama.cpp: each of our systems' tokens/s over llama.cpp's
    on the same prompt (medians over the repeats), and the median of that over the prompts (range)."""
    parts = []
    for cap in load(name)["per_prompt"]:
        ratios: dict[str, list[float]] = {}
        for prompt in cap["prompts"]:
            speeds = prompt["tokens_per_s"]
            for system, speed in speeds.items():
                if system != "llama.cpp" and speed and speeds.get("llama.cpp"):
                    ratios.setdefault(system, []).append(speed / speeds["llama.cpp"])
        parts.append(f"at {num(cap['cap_bytes'] / 1e9, 1)} GB over {len(cap['prompts'])} prompt(s): " + ", ".join(
            f"{system} {spread(median(r), [min(r), max(r)])}x" for system, r in ratios.items()))
    return "Over llama.cpp, prompt by prompt: " + "; ".join(parts) + "."


def half_rows(name: str) -> Rows:
    """Per thread count and expert matrix: each decode-row kernel's GB/s of weights, and how much
    sooner the bfloat16 row kernel finishes a matrix than the float32 one (half the bytes)."""
    runs = load(name)["runs"]
    kernels = list(next(iter(runs.values()))["gb_s"])
    rows = [[label, *(num(run["gb_s"][k], 1) for k in kernels),
             num(2 * run["gb_s"]["bfloat16 rows"] / run["gb_s"]["float32 rowdot"])] for label, run in runs.items()]
    return ["threads, matrix", *(f"{k} GB/s" for k in kernels), "bfloat16 rows over float32 rowdot (speed)"], rows


def half_note() -> str:
    """The row kernels' largest error against float64 products, over every matrix measured."""
    runs = load(HALF)["runs"].values()
    worst = {k: max(run["relative_error"][k] for run in runs) for k in next(iter(runs))["relative_error"]}
    return ("Largest error of a product against float64's, relative to its largest entry: "
            + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()) + ".")


def demo_user_note() -> str:
    """The whole ms of a decoded token of the demo's model as `prescient generate` runs it: the bound of its overhead."""
    speed = {e["system"]: e["tokens_per_s"]["median"] for e in load(DEMO_USER)["summary"]}
    return (f"A decoded token of the runtime takes {num(1e3 / speed['prescient'])} ms with SiDA's predictor and "
            f"{num(1e3 / speed['no-predictor'])} ms without (medians), the experts' work included: issue 52's target "
            f"for the per-token overhead is 2 ms. llama.cpp's takes {num(1e3 / speed['llama.cpp'])} ms.")


def _against(exact: dict | None) -> str:
    """A kernel's check against transformers' own: tokens and logits; llama.cpp's, its greedy text."""
    if exact is None:
        return "reference"
    if "same_text" in exact:
        return (f"greedy text {'the same' if exact['same_text'] else 'DIFFERS'} as far as both go "
                f"({'whole' if exact['text_equal'] else 'one runs on past the other'}), {exact['runs']} runs")
    return (f"tokens {'equal' if exact['tokens_equal'] else 'DIFFER'}, logits within "
            f"{exact['max_logit_difference']:.1e}")


def _per_token_tables() -> tuple[Table, ...]:
    """The per-token path beside llama.cpp: every expert in memory (per kernel and thread count), the demo's
    per-token overhead, runs/tw under caps, and the earlier and bfloat16 measurements."""
    llama = ("The per-token path on {model}, every expert in memory, beside llama.cpp: transformers' own experts "
             "kernel (`model`), `streamed` and `gemv` ({gemv}) in the plain model, and llama.cpp's "
             "`llama-completion` on the model converted to an f32 GGUF, memory-mapped (its own 'eval time' line), the "
             "same prompt, 96 greedy tokens, thread counts and kernels interleaved in each of 3 repeats (medians and "
             "ranges; through ../shared/bin/quiet, load average {load} at the start)")
    return (
        *(Table(llama.format(model=model, gemv=ROWDOT, load=num(load(name)["machine"]["load_average_at_start"][0], 2)),
                (name,),
                load(name)["command"], partial(decode_kernel_rows, name), note=llama_note(name))
          for name, model in (("bench-decode-tw-rowdot.json", "runs/tw (2.2 GB of float32 experts)"),
                              ("bench-decode-tb-rowdot.json", "runs/tb (733 MB of float32 experts)"),
                              ("bench-decode-demo-llama.json", "the demo's tiny model (its expert matrices are "
                               "under 1 MiB: `gemv` runs torch's `linear` there, as before the row kernel)"))),
        Table(llama.format(model="the demo's tiny model", gemv=ROWDOT, load=num(
                  load(DEMO)["machine"]["load_average_at_start"][0], 2)) + ", and the per-token overhead: a decoded "
              "token's ms less its layers' experts' ms, those timed alone",
              (DEMO,), load(DEMO)["command"], partial(decode_kernel_rows, DEMO), note=llama_note(DEMO)),
        Table("The demo's tiny model as `prescient generate` runs it (the memory plan holds it whole: the resident "
              "runtime), plain transformers, the model memory-mapped and llama.cpp, each run a fresh process in a "
              "memory cgroup of 2 GB; 3 held-out prompts, 96 greedy tokens, 2 interleaved repeats (medians and "
              "ranges; through ../shared/bin/quiet, load average 1.27 at the start)", (DEMO_USER,),
              "prescient bench --model runs/demo/model --predictor runs/demo/predictor/sida --memory 2GB --systems "
              "plain,no-predictor,prescient,mmap,llama.cpp --llama-cpp /work/llama/llama.cpp/build/bin --gguf "
              "runs/gguf/demo-f32.gguf --prompts 3 --repeats 2 --new-tokens 96 --run-timeout 120 --json "
              "results/bench-memory-demo-resident.json", partial(systems_rows, DEMO_USER), note=demo_user_note()),
        *(Table(f"runs/tw at {cap} beside llama.cpp, the experts that do not fit read from disk: " + CAPPED, (name,),
                command, partial(systems_rows, name),
                note=llama_memory_note(name) + f" Load average {num(load(name)['machine']['load_average_at_start'][0])} "
                "at the start." + note)
          for name, cap, command, note in CAPPED_RUNS),
        *(Table("Earlier, before the row kernel: " + llama.format(model=model, gemv=ONEDNN, load=num(
                    load(name)["machine"]["load_average_at_start"][0], 2)), (name,),
                load(name)["command"], partial(decode_kernel_rows, name), note=llama_note(name))
          for name, model in (("bench-decode-tw-llama.json", "runs/tw (2.2 GB of float32 experts)"),
                              ("bench-decode-tb-llama.json", "runs/tb (733 MB of float32 experts)"))),
        Table("Half precision on this CPU, one decode row against an expert matrix: torch's `linear` in float32, "
              "bfloat16 and float16, the default kernel's `rowdot` (float32) and a bfloat16 row kernel of the same "
              "shape (each weight widened to float32 exactly, in blocks that stay in L1, summed in float32; a "
              "measurement, not in the engine: it rounds otherwise than torch's bfloat16 `linear`); 16 distinct "
              "matrices read in turn, best of 7 passes (through ../shared/bin/quiet, load average "
              f"{num(load(HALF)['machine']['load_average_at_start'][0], 2)} at the start)", (HALF,),
              load(HALF)["command"], partial(half_rows, HALF), note=half_note()),
        Table("bfloat16 on runs/tb, every expert in memory, 2 threads: the default kernel (`gemv`) runs no row "
              "kernel in bfloat16 (then none of oneDNN's either), so it is `streamed`, transformers' grouped_mm "
              "numbers bit for bit; 96 greedy "
              "tokens, kernels interleaved in 3 repeats (medians and ranges; through ../shared/bin/quiet, load "
              f"average {num(load(BF16)['machine']['load_average_at_start'][0], 2)} at the start)", (BF16,),
              load(BF16)["command"], partial(decode_kernel_rows, BF16)),
        *(Table(f"Earlier: the per-token path on {model}, every expert in memory: transformers' own experts kernel "
                "(`model`, grouped_mm on the CPU), `streamed` (its steps without its per-call work, bit for bit) and "
                "`gemv` (a decode row's matrix-vector products through oneDNN where measured faster for the shape), "
                "96 greedy tokens, 3 interleaved repeats (medians and ranges); opt-in with `--expert-kernel` then; "
                "2-thread figures were taken while other jobs ran and are unsteady", (name,), load(name)["command"],
                partial(decode_kernel_rows, name))
          for name, model in (("bench-decode-tw.json", "runs/tw (2.2 GB of float32 experts)"),
                              ("bench-decode-demo.json", "the demo's tiny model"))),
    )


def page() -> Page:
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
        *_per_token_tables(),
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


def _bench(name: str, label: str) -> float:
    return load(name)["ratios"][label]["tokens_per_s"]


SAMPLED = "bench-runtime-base-sampled.json"
HALF = "bench-half-rows.json"  # half-precision decode rows (issue 52 item 3)
DEMO = "bench-decode-demo-overhead.json"  # the demo's per-token overhead (issue 52)
DEMO_USER = "bench-memory-demo-resident.json"  # the same through the runtime, fresh processes
BF16 = "bench-decode-tb-bf16.json"  # the default kernel in bfloat16 (issue 52)
ROWDOT = ("the default since issue 52: a decode row against a float32 matrix of 1 MiB or more through `rowdot`, a dot "
          "product per row compiled by numba")
ONEDNN = ("then a decode row through oneDNN's matrix-vector product, where a timing in each process found it faster "
          "than torch's `linear`")
CAPPED = ("the runtime without a predictor and with SiDA's (`runs/demo/predictor/sida`; `--memory`'s defaults: gemv, "
          "2 threads), the model memory-mapped, plain transformers where named, and llama.cpp's `llama-completion` on "
          "an f32 GGUF, memory-mapped; each run a fresh "
          "process in a memory cgroup at the cap, page cache dropped first; held-out prompts of 16 tokens, 96 greedy "
          "tokens, systems interleaved per prompt in each repeat (medians and ranges over every run; through "
          "../shared/bin/quiet); llama.cpp is exact when its greedy text is the plain model's as far as both go")
FAIR = " llama.cpp's process was started by a child that holds nothing of torch (b18ef03)."
MEMORY_BENCH = ("prescient bench --model runs/tw --memory {cap} --systems {systems} --llama-cpp "
                "/work/llama/llama.cpp/build/bin --gguf runs/gguf/tw-f32.gguf --new-tokens 96 {rest} --json results/{name}")
CAPPED_RUNS = (  # (results file, cap, command, what the note adds)
    ("bench-memory-tw-1.7-llama.json", "1.7 GB", MEMORY_BENCH.format(
        cap="1.7GB", systems="plain,no-predictor,prescient,mmap,llama.cpp", name="bench-memory-tw-1.7-llama.json",
        rest="--predictor runs/demo/predictor/sida --prompts 2 --repeats 2 --run-timeout 90"), FAIR),
    ("bench-memory-tw-1.1-llama.json", "1.1 GB", MEMORY_BENCH.format(
        cap="1.1GB", systems="no-predictor,prescient,mmap,llama.cpp", name="bench-memory-tw-1.1-llama.json",
        rest="--predictor runs/demo/predictor/sida --prompts 4 --repeats 2 --run-timeout 150"),
     FAIR + " Plain transformers is left out: it is killed or thrashes to the limit at 1.1 GB (the memory page)."),
    ("bench-memory-tw-1.1-llama-heavy-child.json", "1.1 GB, llama.cpp handicapped (a first run, kept as the record)",
     MEMORY_BENCH.format(cap="1.1GB", systems="no-predictor,prescient,mmap,llama.cpp",
                         name="bench-memory-tw-1.1-llama-heavy-child.json",
                         rest="--predictor runs/demo/predictor/sida --prompts 4 --repeats 2 --run-timeout 150"),
     " This run's llama.cpp was started by a child that had imported torch, transformers and numba (since "
     "f7a0339, through `engine.generate.storage_reads`): ~290 MB of anonymous memory and 130 MB of library pages "
     "held inside llama.cpp's cgroup, so it read ~460 MiB a token where it reads tens; fixed in b18ef03. The "
     "row-kernel run at 1.7 GB on the memory page (bench-memory-tw-rowdot.json) had the same handicap."),
)
HEADLINES: tuple[Headline, ...] = (
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
)
