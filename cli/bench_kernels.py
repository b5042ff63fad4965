"""`prescient bench-kernels`: EPS-MoE's load-aware expert kernels ("auto") against the model's own
in Klotski's batch decoder: the crossover measured on this machine for the model's layer shape,
then interleaved runs at each N:μ:r_w, tokens/s and exactness (JSON); see `experiments.bench_kernels`."""

from __future__ import annotations

import argparse
import shlex
import sys

from cli.args import add_results_args, positive_int, runtime_options
from cli.bench_batch import add_batch_run_args, batch_policies
from cli.commands import add_command
from experiments.bench_batch_shared import ARMS, DEFAULT_POLICIES


def arms(text: str) -> tuple[str, ...]:
    """"model,auto,..." → the arms, model first whether named or not."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = sorted(set(names) - set(ARMS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown arm {', '.join(unknown)}; arms are {', '.join(ARMS)}")
    return tuple(dict.fromkeys(["model", *names]))


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = add_command(subparsers, "bench-kernels")
    p.add_argument("--model", required=True, help="Hugging Face model directory (e.g. the bench reference model)")
    add_results_args(p, "results file (rewritten after every run; holds the crossover table --expert-kernel-table "
                        "reads)", plot=None)
    p.add_argument("--policies", type=batch_policies, default=DEFAULT_POLICIES,
                   help="Klotski policies N:MICRO_BATCH:RESIDENT,... each arm runs at")
    p.add_argument("--arms", type=arms, default="model,auto",
                   help="what runs against the model's own kernel: auto; auto-pipelined (auto's kernels with the "
                        "per-expert pipeline at every load: what skipping it changes)")
    p.add_argument("--repeats", type=positive_int, default=3, help="interleaved repeats (model, auto, model, ...)")
    p.add_argument("--crossover-repeats", type=positive_int, default=3,
                   help="timings per kernel and load in the crossover (the best is kept)")
    add_batch_run_args(p)
    return p


def run(args: argparse.Namespace) -> int:
    from experiments.bench_kernels import bench_kernels

    shortest, longest = args.prompt_tokens
    result = bench_kernels(args.model, args.json, args.policies, repeats=args.repeats, gen_len=args.gen_len,
                           shortest=shortest, longest=longest, trace=args.trace, threads=args.threads,
                           options=runtime_options(args, policy="fifo", drop_page_cache=not args.keep_page_cache),
                           dataset=args.dataset, split=args.split, crossover_repeats=args.crossover_repeats,
                           command=shlex.join(["prescient", *sys.argv[1:]]), arms=args.arms)
    table = result["crossover"]
    print("crossover (tokens per expert: kernel): " + ", ".join(f"{m}: {k}" for m, k in zip(table["loads"],
                                                                                           table["kernels"]))
          + f"; per-expert pipeline from {table['pipeline_from']} tokens per expert")
    for label, row in result["summary"]["by_policy"].items():
        speeds = ", ".join(f"{arm} {m['tokens_per_s']['median']:.2f}" for arm, m in row["arms"].items())
        ratios = ", ".join(f"{arm}/model {row[f'{arm}_over_model']['tokens_per_s']['ratio_of_medians']:.2f}x (paired "
                           f"{row[f'{arm}_over_model']['tokens_per_s']['paired']['min']:.2f}-"
                           f"{row[f'{arm}_over_model']['tokens_per_s']['paired']['max']:.2f})" for arm in args.arms[1:])
        print(f"{label}: tokens/s end to end (median of {args.repeats}) {speeds}; {ratios}; exact {row['exact']}")
    for check in result["logits_check"]:
        print(f"logits, {check['expert_kernel']} against the plain model: {check['batch_prompts']} prompts in one "
              f"forward equal {check['batch_logits_equal']} (max difference {check['batch_max_logit_difference']:.3g}); "
              f"one prompt greedy: tokens equal {check['tokens_equal']}, logits equal {check['logits_equal']} (max "
              f"difference {check['max_logit_difference']:.3g})")
    print(f"every batch output equal to the plain model: {result['summary']['all_exact']}; results in {args.json}")
    return 0
