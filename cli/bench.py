"""`prescient bench`: decode tokens/s and memory of the offloading runtime across budgets,
predictors and policies, with all-resident and accelerate disk-offload baselines (JSON + PNG);
see `experiments.bench_runtime.bench`. With `--memory 0.5GiB,1GiB,...`: tokens/s against a
memory cap instead, for the plain model, the model memory-mapped and the runtime, each run under
the cap (`experiments.bench_memory`)."""

from __future__ import annotations

import argparse

from cli.args import (add_next_token_min_chance, add_results_args, add_runtime_args, budgets, list_of, memory, names,
                      positive_int, predictor_specs, runtime_options, seed, threads)
from cli.commands import add_command

BASELINES = "all_resident,accelerate_disk"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = add_command(subparsers, "bench")
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    add_results_args(p, "results file (rewritten after every run)")
    p.add_argument("--budgets", type=budgets, default="0.25,0.5,1.0", help="expert memory, as fractions of all experts")
    p.add_argument("--predictors", type=predictor_specs, default="none,freq,corr,oracle",
                   help="comma list of none, freq, token, corr, oracle or NAME=ARTIFACT (e.g. sida=runs/sida)")
    p.add_argument("--policies", type=names, default="lru,lfu,fifo,mrs",
                   help="policies for sida (default grid) or all (full)")
    p.add_argument("--grid", choices=("default", "full"), default="default",
                   help="default: per budget none+lru, each predictor with mrs and lru, sida with every policy; "
                        "full: budgets x predictors x policies")
    p.add_argument("--runs", help="these runs instead of a grid: PREDICTOR:POLICY@BUDGET[+hide][+next][+look]"
                                  "[+serial][+hybrid],... (+hide: hide-only prefetch, needs --link-timing; +next: "
                                  "cross-token prefetch, needs a predictor with forecast heads; +look: in-token "
                                  "lookahead one layer ahead, by the routers or --lookahead-probe; +serial: without "
                                  "the expert pipeline, a layer waits for all its copies; +hybrid: HybriMoE's "
                                  "scheduler, generate's --hybrid-schedule; a run named twice runs twice)")
    p.add_argument("--train-trace", help="trace that freq / token / corr are fit on")
    _add_memory_curve_args(p)
    p.add_argument("--new-tokens", type=positive_int, default=None,
                   help="new tokens per timed prompt (default 12; with --memory, 128)")
    p.add_argument("--prompts", type=positive_int, default=2, help="timed prompts (one more is the warm-up)")
    p.add_argument("--prompt-tokens", type=positive_int, default=16, help="tokens per prompt")
    p.add_argument("--warmup-tokens", type=positive_int, default=4, help="new tokens of the untimed warm-up prompt")
    p.add_argument("--sample", type=seed, default=None, metavar="SEED",
                   help="sampled decoding under the model's generation settings, seeded per prompt by SEED "
                        "(default: greedy)")
    p.add_argument("--dataset", default="stdlib-code", help="corpus the prompts come from")
    p.add_argument("--split", default="validation")
    p.add_argument("--baselines", type=names, default=BASELINES, help=f"comma list of {BASELINES}")
    p.add_argument("--baseline-tokens", type=positive_int, default=4, help="new tokens of the accelerate_disk run")
    p.add_argument("--hash-cost", default="auto",
                   help="predictor of hash_thread_cost; auto: sida if given, else skipped; off: skipped")
    p.add_argument("--threads", type=threads, default=None,
                   help="torch threads per run (default: torch's; with --memory, what generate and serve use: the "
                        "CPUs this process may use, capped by its cgroup's CPU quota)")
    add_runtime_args(p, "store", "transfer_workers", "dtype", "slot_format", "lookahead_probe")  # each run names its policy, budget and prefetch modes
    p.add_argument("--keep-page-cache", action="store_true", help="disk store: leave read pages in the page cache")
    p.add_argument("--in-process", action="store_true", help="every run in this process (quick checks)")
    p.add_argument("--simulate", action="store_true",
                   help="replay each run in the time-true simulator, calibrated from this bench, and report its "
                        "tokens/s beside the measured (Spearman, median relative error)")
    p.add_argument("--link-timing", metavar="BENCH.json|PROFILE.json",
                   help="the link that +hide runs weigh copies against: calibrated from a `prescient bench` JSON, "
                        "or a `prescient profile-hw` JSON with the model's config")
    add_next_token_min_chance(p, "+next runs")
    p.add_argument("--work-dir", help="keep fitted predictors and the oracle trace here (default: a temporary dir)")
    return p


def _add_memory_curve_args(p: argparse.ArgumentParser) -> None:
    """`--memory` and the flags only the memory curve reads (`experiments.bench_memory`)."""
    p.add_argument("--memory", type=list_of(memory), metavar="SIZES",
                   help="comma list of memory caps (8GiB, 1.5GB or 25%%): the memory curve instead of the budget grid, "
                        "tokens/s of the plain model, the model memory-mapped and the runtime, each run in a cgroup "
                        "capped at the size")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="--memory: interleaved rounds of the systems per cap")
    p.add_argument("--predictor", metavar="ARTIFACT", help="--memory: the runtime's predictor (default: none)")
    p.add_argument("--systems", type=names, default=None, metavar="NAMES",
                   help="--memory: comma list of plain, mmap, no-predictor, prescient (the runtime with --predictor), "
                        "prefetch (prescient with in-token prefetch), next (prescient with cross-token prefetch), "
                        "oracle, llama.cpp (with --llama-cpp and --gguf) (default: all but next; prescient, prefetch "
                        "and next only with --predictor, llama.cpp only with --llama-cpp)")
    p.add_argument("--llama-cpp", metavar="BIN_DIR",
                   help="--memory: a llama.cpp build's bin folder (llama-completion): llama.cpp runs beside the other "
                        "systems, in the same cgroups, on --gguf (docs/memory.md; default: not run)")
    p.add_argument("--gguf", metavar="MODEL.gguf", help="--memory: the model converted to GGUF, for --llama-cpp")
    p.add_argument("--run-timeout", type=positive_int, default=1800, metavar="S",
                   help="--memory: seconds before a run is stopped and recorded as timed out")


def run_memory(args: argparse.Namespace) -> dict:
    """The memory curve (`experiments.bench_memory`)."""
    from experiments.bench_memory.orchestrate import bench_memory, corpus_prompts, summary_text
    from offload_runtime.engine.threads import decode_threads
    from prescient.model_dir import ModelDirectory
    from training.corpora import load_corpus

    directory = ModelDirectory.open(args.model)
    texts = list(load_corpus(args.dataset, args.split)["text"][:200])
    prompts = corpus_prompts(directory.tokenizer(), texts, args.prompt_tokens, args.prompts)
    result = bench_memory(directory.path, args.memory, prompts, json_path=args.json, plot_path=args.plot,
                          new_tokens=args.new_tokens or 128, repeats=args.repeats, threads=args.threads or decode_threads(),
                          predictor=args.predictor, systems=tuple(args.systems) if args.systems else None,
                          timeout_s=args.run_timeout, llama_cpp=args.llama_cpp, gguf=args.gguf)
    print(summary_text(result))
    return result


def run(args: argparse.Namespace) -> dict:
    if args.memory:
        return run_memory(args)
    from experiments.bench_runtime.bench import bench_runtime
    from experiments.bench_runtime.grid import (BASELINES, BenchError, check_grid, default_grid, fraction, full_grid,
                                                parse_runs)
    from experiments.bench_runtime.records import summary
    from predictor.registry import canonical_name
    from training.corpora import load_corpus

    predictors = {canonical_name(name) if path is None else name: path for name, path in args.predictors.items()}
    grid = full_grid if args.grid == "full" else default_grid
    runs = parse_runs(args.runs) if args.runs else grid([fraction(b) for b in args.budgets], list(predictors),
                                                        list(args.policies))
    if set(args.baselines) - set(BASELINES):
        raise BenchError(f"unknown baselines {sorted(set(args.baselines) - set(BASELINES))}; "
                         f"use {', '.join(BASELINES)}")
    hash_cost = {"auto": "sida" if "sida" in predictors else None, "off": None}.get(args.hash_cost, args.hash_cost)
    used = {spec.predictor for spec in runs} | {hash_cost}
    check_grid(runs, {k: v for k, v in predictors.items() if k in used}, args.train_trace)  # before reading the corpus
    texts = list(load_corpus(args.dataset, args.split)["text"][: 20 * (args.prompts + 1)])
    result = bench_runtime(
        args.model, texts, predictors=predictors, runs=runs, timed_prompts=args.prompts,
        prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens or 12, warmup_tokens=args.warmup_tokens,
        train_trace=args.train_trace, baselines=tuple(args.baselines), baseline_tokens=args.baseline_tokens,
        sample_seed=args.sample, options=runtime_options(args, drop_page_cache=not args.keep_page_cache),
        hash_cost_predictor=hash_cost, threads=args.threads, isolate=not args.in_process, work_dir=args.work_dir,
        simulate=args.simulate, link_timing=args.link_timing, next_token_min_chance=args.next_token_min_chance,
        json_path=args.json,
        plot_path=args.plot,
    )
    print(summary(result))
    return result
