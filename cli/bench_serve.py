"""`prescient bench-serve`: load test of `prescient serve` on localhost (see
`experiments.bench_serve`): 1..64 concurrent clients, with and without a predictor; throughput,
p50/p99 latency and time to first token in a JSON and a plot."""

from __future__ import annotations

import argparse

from cli.args import (add_runtime_args, output_file, positive_int, positive_ints, predictor_specs, runtime_options,
                      seconds, threads)
from cli.commands import add_command


def served_predictors(text: str) -> dict[str, str | None]:
    """`none,sida=PATH`: the servers' predictors; each but `none` needs an artifact."""
    specs = predictor_specs(text)
    for name, path in specs.items():
        if path is None and name != "none":
            raise argparse.ArgumentTypeError(f"predictor {name!r} needs an artifact (NAME=PATH); serving loads "
                                             "artifacts only")
    return specs


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = add_command(subparsers, "bench-serve")
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--predictors", type=served_predictors, default={"none": None},
                   help="server settings to compare: none (no predictor) and NAME=ARTIFACT, e.g. "
                        "none,sida=runs/demo/predictor/sida")
    add_runtime_args(p, "policy", "budget", "drop_page_cache", "dtype", "slot_format")  # the servers' runtime options
    p.add_argument("--clients", type=positive_ints, default=(1, 4, 16, 64), help="concurrency levels")
    p.add_argument("--rounds", type=positive_int, default=2, help="requests per client at each level")
    p.add_argument("--max-requests", type=positive_int, default=64, help="at most this many requests per level")
    p.add_argument("--max-tokens", type=positive_int, default=32, help="tokens generated per request")
    p.add_argument("--repeats", type=positive_int, default=3, help="server runs per setting (medians and spread)")
    p.add_argument("--level-time", type=seconds, default=300.0, help="seconds per level before no new request starts")
    p.add_argument("--request-timeout", type=seconds, default=300.0, help="seconds before a request counts as hung")
    p.add_argument("--max-batch", type=positive_int, default=64, help="the server's --max-batch")
    p.add_argument("--max-queue", type=positive_int, default=64, help="the server's --max-queue")
    p.add_argument("--threads", type=threads, default=1, help="the server's torch threads")
    p.add_argument("--json", type=output_file, required=True, metavar="OUT")
    p.add_argument("--plot", type=output_file, default=None, metavar="OUT.png")
    return p


def run(args: argparse.Namespace) -> None:
    from experiments.bench_serve import bench_serve

    result = bench_serve(args.model, args.json, args.plot, predictors=args.predictors,
                         options=runtime_options(args), clients=args.clients, rounds=args.rounds,
                         max_requests=args.max_requests, max_tokens=args.max_tokens, repeats=args.repeats,
                         level_time_s=args.level_time, request_timeout_s=args.request_timeout, threads=args.threads,
                         max_batch=args.max_batch, max_queue=args.max_queue)
    for name, levels in result["summary"].items():
        for clients, row in levels.items():
            print(f"{name:>8} {clients:>3} clients: {row['tokens_per_s_median']} tokens/s "
                  f"(x{row['speedup_over_1_client_median']} over 1 client), lost {row['lost']}, "
                  f"refused {row['refused']}")
