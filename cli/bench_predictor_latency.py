"""`prescient bench-predictor-latency`: milliseconds per decode step of the SiDA hash function;
see `training.predictor_latency`."""

from __future__ import annotations

import argparse

from cli.args import output_file, positive_int, threads
from cli.commands import add_command


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = add_command(subparsers, "bench-predictor-latency")
    p.add_argument("--artifact", help="a saved sida predictor (default: random weights of the default sizes)")
    p.add_argument("--n-layers", type=positive_int, default=32, help="MoE layers (no artifact)")
    p.add_argument("--n-experts", type=positive_int, default=8, help="experts per layer (no artifact)")
    p.add_argument("--vocab-size", type=positive_int, default=32000, help="vocabulary (no artifact)")
    p.add_argument("--batch-size", type=positive_int, default=1, help="rows decoded together")
    p.add_argument("--threads", type=threads, default=1, help="torch intra-op threads")
    p.add_argument("--tokens", type=positive_int, default=2000, help="timed steps after the warm-up")
    p.add_argument("--cold-mb", type=positive_int, default=None, metavar="MB",
                   help="stream this many MB of weights before each step, as the decode's experts do (default: none)")
    p.add_argument("--json", type=output_file, help="JSON file for the result")
    return p


def run(args: argparse.Namespace) -> dict:
    from training.predictor_latency import measure_step_latency

    return measure_step_latency(args.artifact, n_layers=args.n_layers, n_experts=args.n_experts,
                                vocab_size=args.vocab_size, batch_size=args.batch_size, threads=args.threads,
                                tokens=args.tokens, out=args.json, cold_mb=args.cold_mb or 0)
