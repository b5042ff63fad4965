"""`prescient bench-batch`: Klotski's pipeline, CGOPipe and FlexGen's zig-zag schedule at the same
budget (plus the sequential, accelerate and all-resident baselines), end to end with prefill, in
interleaved repeats, each beside the HRM's prediction; Klotski's planner against a sweep of group
sizes; HRM predictions against measurements over a policy grid (JSON + PNG); see
`experiments.bench_batch`."""

from __future__ import annotations

import argparse

from cli.args import add_results_args, add_runtime_args, non_negative_int, positive_int, runtime_options, share, threads
from cli.commands import add_command
from experiments.bench_batch_shared import ACCELERATE_RUNS, DEFAULT_GRID


def batch_policies(text: str, allow_none: bool = False) -> list:
    """"N:μ:r_w,..." → `BatchPolicy`s, refused in one line when malformed or empty."""
    from experiments.bench_batch import BenchBatchError, parse_grid

    if allow_none and text.strip().lower() == "none":
        return []
    try:
        policies = parse_grid(text)
    except BenchBatchError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not policies:
        raise argparse.ArgumentTypeError(f"{text!r} names no N:MICRO_BATCH:RESIDENT policy")
    for p in policies:
        if p.requests % p.micro_batch or not 0 <= p.resident <= 1:
            raise argparse.ArgumentTypeError(f"{p.label}: N must be a multiple of the micro-batch size (the group is "
                                             "N/MICRO_BATCH micro-batches) and r_w must lie in [0, 1]")
    return policies


def optional_policies(text: str) -> list:
    return batch_policies(text, allow_none=True)


def group_sizes(text: str) -> list[int]:
    """"1,2,4,8" → group sizes n (each at least 1), or "none"."""
    if text.strip().lower() == "none":
        return []
    try:
        sizes = [positive_int(x) for x in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r}: group sizes are whole numbers of at least 1, e.g. 1,2,4,8") from None
    return sorted(set(sizes))


def prompt_range(text: str) -> tuple[int, int]:
    try:
        shortest, longest = (positive_int(x) for x in text.split(","))
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"{text!r} is not SHORTEST,LONGEST (e.g. 16,48)") from None
    return shortest, longest


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = add_command(subparsers, "bench-batch")
    p.add_argument("--model", required=True, help="Hugging Face model directory (e.g. the bench reference model)")
    add_results_args(p, "results file (rewritten after every run)")
    p.add_argument("--policy", type=batch_policies, default="64:16:0.5",
                   help="main policy N:MICRO_BATCH:RESIDENT (all-resident and sequential run here too)")
    p.add_argument("--compare", type=optional_policies, default="8:4:0.5,16:4:0.5",
                   help="more policies every schedule runs at, or none")
    p.add_argument("--sequential-at", type=optional_policies, default="none",
                   help="more policies to run the sequential baseline at (beside the main one), or none")
    p.add_argument("--grid", type=optional_policies, default=DEFAULT_GRID,
                   help="policies of the HRM validation, N:MICRO_BATCH:RESIDENT,..., or none")
    p.add_argument("--repeats", type=positive_int, default=3, help="interleaved repeats of every compared run")
    p.add_argument("--accelerate", choices=ACCELERATE_RUNS, default="repeats",
                   help="the accelerate baseline (transformers' own disk offloading at the same weight bytes): in "
                        "every repeat, in the first only, or not at all")
    p.add_argument("--hot-count", type=non_negative_int, default=None,
                   help="Klotski's K hot experts per layer (default: the model's top-k; the sweep: the planner's)")
    p.add_argument("--correlation", help="a saved klotski-correlation table (default: built from --trace)")
    p.add_argument("--sweep-micro-batch", type=positive_int, default=4, help="μ of the group-size sweep")
    p.add_argument("--sweep-resident", type=share, default=0.5, help="r_w of the group-size sweep")
    p.add_argument("--sweep-groups", type=group_sizes, default="1,2,4,8,16",
                   help="group sizes n of Klotski's planner check (N = n·μ), or none")
    p.add_argument("--hardware", help="hardware profile JSON or preset for the HRM (default: measure this machine)")
    add_batch_run_args(p)
    return p


def add_batch_run_args(p: argparse.ArgumentParser) -> None:
    """What every batch benchmark's run takes: its requests, the hot ranking and table, the store."""
    p.add_argument("--gen-len", type=positive_int, default=8, help="tokens generated per request")
    p.add_argument("--prompt-tokens", type=prompt_range, default="16,48", help="shortest,longest prompt (spread evenly)")
    p.add_argument("--trace", help="trace whose expert frequencies pick the resident (hot) experts and whose "
                                   "routing builds Klotski's correlation table")
    add_runtime_args(p, "store")  # the policy is fifo, each run's budget what its r_w needs
    p.add_argument("--keep-page-cache", action="store_true", help="disk store: leave read pages in the page cache")
    p.add_argument("--dataset", default="stdlib-code")
    p.add_argument("--split", default="validation")
    p.add_argument("--threads", type=threads, default=1, help="torch threads")


def run(args: argparse.Namespace) -> int:
    from experiments.bench_batch import bench_batch

    shortest, longest = args.prompt_tokens
    main = args.policy[0]
    compared = list(dict.fromkeys([main, *args.compare, *args.sequential_at]))
    sweep = (args.sweep_micro_batch, args.sweep_resident, args.sweep_groups) if args.sweep_groups else None
    result = bench_batch(args.model, args.json, args.plot, compared, args.grid, [main, *args.sequential_at],
                         args.gen_len, shortest, longest, args.hardware, args.trace, repeats=args.repeats,
                         sweep=sweep, correlation=args.correlation, hot_count=args.hot_count,
                         options=runtime_options(args, policy="fifo", drop_page_cache=not args.keep_page_cache),
                         dataset=args.dataset, split=args.split, threads=args.threads, accelerate=args.accelerate)
    for label, row in result["by_policy"].items():
        modes = row["modes"]
        speeds = ", ".join(f"{mode} {m['tokens_per_s']['median']:.2f}" for mode, m in modes.items())
        moved = ", ".join(f"{mode} {m['bytes_per_token']['median'] / 1e6:.1f}" for mode, m in modes.items())
        print(f"{label}: tokens/s end to end (median of {args.repeats}) {speeds}; MB moved per token {moved}; "
              f"Klotski/CGOPipe {row['klotski_over_cgopipe']:.2f}x (as the paper {row['klotski_paper_over_cgopipe']:.2f}x), CGOPipe/zig-zag {row['cgopipe_over_zigzag']:.2f}x, "
              f"Klotski/zig-zag {row['klotski_over_zigzag']:.2f}x"
              + (f", CGOPipe/accelerate {row['cgopipe_over_accelerate']:.2f}x" if "accelerate" in modes else "")
              + f"; a step activates {modes['klotski']['activated_share']:.0%} of a layer's experts")
        hrm = ", ".join(f"{mode} {m['predicted_tokens_per_s']:.2f} ({m['prediction_over_measured']['tokens_per_s']:.2f}x)"
                        for mode, m in modes.items() if "predicted_tokens_per_s" in m)
        print(f"  HRM predicted tokens/s end to end (over measured): {hrm}")
    print(f"all resident at {main.label}: {result['resident']['tokens_per_s']:.2f} tokens/s end to end")
    if "klotski_sweep" in result:
        s = result["klotski_sweep"]
        print(f"Klotski's planner picks n={s['planner_group_size']} (K={result['klotski_plan']['hot_count']}), "
              f"{s['planner_gap']:.1%} below the best measured n={s['best_group_size']}")
    if "hrm_schedules" in result:
        h = result["hrm_schedules"]
        print(f"HRM across the compared schedules: Spearman {h['spearman_tokens_per_s']:.3f} end to end, "
              f"{h['spearman_decode_tokens_per_s']:.3f} decode, over {h['pairs']} (policy, schedule) pairs")
    if "hrm" in result:
        h = result["hrm"]
        print(f"HRM: Spearman {h['spearman']:.3f} over {h['grid_size']} policies; planner picks {h['planner_choice']}, "
              f"{h['planner_gap']:.1%} below the best measured ({h['best_measured']})")
    print(f"every output equal to the plain model: {result['all_exact']}; results in {args.json}")
    return 0
