"""`prescient routing-stats`: how a MoE model routes on held-out text (JSON + PNG); see
`training.routing_stats` for the statistics."""

from __future__ import annotations

import argparse

from cli.args import add_results_args, positive_int
from cli.commands import add_command


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = add_command(subparsers, "routing-stats")
    p.add_argument("--model", required=True, help="Hugging Face model directory (or hub name), decoder-only")
    p.add_argument("--dataset", default="stdlib-code", help="stdlib-code, stdlib-docs, json:PATH, ... or a hub name")
    p.add_argument("--split", default="validation", choices=("train", "validation", "test"))
    p.add_argument("--fit-split", default="train", choices=("train", "validation", "test"),
                   help="split the per-token-id table is fit on")
    p.add_argument("--text-field", default="text")
    p.add_argument("--seq-len", type=positive_int, default=256)
    p.add_argument("--windows", type=positive_int, default=256, help="held-out windows measured")
    p.add_argument("--fit-windows", type=positive_int, default=1024, help="windows the token table is fit on")
    add_results_args(p)
    return p


def run(args: argparse.Namespace) -> None:
    from experiments.routing_stats import run_routing_stats

    result = run_routing_stats(args.json, args.plot, model_dir=args.model, dataset=args.dataset, split=args.split,
                               fit_split=args.fit_split, text_field=args.text_field, seq_len=args.seq_len,
                               windows=args.windows, fit_windows=args.fit_windows)
    summary = result["statistics"]["summary"]
    print("routing over layers 1..L-1: " + ", ".join(f"{k} {v:.3f}" for k, v in summary.items() if v is not None))
