"""`prescient bench-batch`: CGOPipe batch decoding against the same runtime without overlap and
against all-resident generation; HRM predictions against measurements over a policy grid (JSON +
PNG); see `experiments.bench_batch`."""

from __future__ import annotations

import argparse

from cli.args import add_results_args, add_runtime_args, positive_int, runtime_options
from experiments.bench_batch import DEFAULT_GRID

def batch_policies(text: str) -> list:
    """"N:μ:r_w,..." → `BatchPolicy`s, refused in one line when malformed or empty."""
    from experiments.bench_batch import BenchBatchError, parse_grid

    try:
        policies = parse_grid(text)
    except BenchBatchError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not policies:
        raise argparse.ArgumentTypeError(f"{text!r} names no N:MICRO_BATCH:RESIDENT policy")
    return policies


def prompt_range(text: str) -> tuple[int, int]:
    try:
        shortest, longest = (positive_int(x) for x in text.split(","))
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"{text!r} is not SHORTEST,LONGEST (e.g. 16,48)") from None
    return shortest, longest


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench-batch", help="CGOPipe batch decoding vs sequential and all-resident; HRM check")
    p.add_argument("--model", required=True, help="Hugging Face model directory (e.g. the bench reference model)")
    add_results_args(p, "results file (rewritten after every run)")
    p.add_argument("--policy", type=batch_policies, default="64:16:0.5", help="main policy N:MICRO_BATCH:RESIDENT")
    p.add_argument("--sequential-at", type=batch_policies, default="32:4:0.5,32:16:0.5",
                   help="more policies to run the sequential baseline at (beside the main one)")
    p.add_argument("--grid", type=batch_policies, default=DEFAULT_GRID,
                   help="policies of the HRM validation, N:MICRO_BATCH:RESIDENT,...")
    p.add_argument("--gen-len", type=positive_int, default=8, help="tokens generated per request")
    p.add_argument("--prompt-tokens", type=prompt_range, default="16,48", help="shortest,longest prompt (spread evenly)")
    p.add_argument("--hardware", help="hardware profile JSON or preset for the HRM (default: measure this machine)")
    p.add_argument("--trace", help="trace whose expert frequencies pick the resident (hot) experts")
    add_runtime_args(p, "store")  # the policy is fifo, each run's budget what its r_w needs
    p.add_argument("--keep-page-cache", action="store_true", help="disk store: leave read pages in the page cache")
    p.add_argument("--dataset", default="stdlib-code")
    p.add_argument("--split", default="validation")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads")
    return p


def run(args: argparse.Namespace) -> int:
    from experiments.bench_batch import bench_batch

    shortest, longest = args.prompt_tokens
    result = bench_batch(args.model, args.json, args.plot, args.policy[0], args.grid, args.sequential_at,
                         args.gen_len, shortest, longest,
                         args.hardware, args.trace,
                         options=runtime_options(args, policy="fifo", drop_page_cache=not args.keep_page_cache),
                         dataset=args.dataset, split=args.split, threads=args.threads)
    print(f"CGOPipe {result['cgopipe_tokens_per_s']:.2f} tokens/s; sequential {result['sequential_tokens_per_s']:.2f} "
          f"({result['cgopipe_over_sequential']:.2f}x); all resident {result['resident_tokens_per_s']:.2f} "
          f"({result['cgopipe_over_resident']:.2f}x)")
    print(f"HRM: Spearman {result['spearman']:.3f} over {result['grid_size']} policies; planner picks "
          f"{result['planner_choice']}, {result['planner_gap']:.1%} below the best measured ({result['best_measured']})")
    print(f"every output equal to the plain model: {result['all_exact']}; results in {args.json}")
    return 0
