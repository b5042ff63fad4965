"""`prescient ablation`: train the hash function briefly with each loss variant and record
validation recall beside the table baselines; see `training.predictor_ablation`."""

from __future__ import annotations

import argparse

from cli.args import names, output_file, positive_int, seed
from cli.commands import add_command


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = add_command(subparsers, "ablation")
    p.add_argument("trace", help="training trace")
    p.add_argument("out", type=output_file, help="JSON file to write")
    p.add_argument("--model", help="the traced model (default: the one the trace manifest records)")
    p.add_argument("--val-trace", help="validation trace (default: 10%% of the training trace's sequences)")
    p.add_argument("--variants", type=names, help="loss variants to run (default: all)")
    p.add_argument("--max-steps", type=positive_int, default=600, help="optimizer steps per variant")
    p.add_argument("--val-every", type=positive_int, default=100, help="validate every this many steps")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--window", type=positive_int, default=128, help="tokens per training window")
    p.add_argument("--batch-size", type=positive_int, default=64, help="windows per batch")
    p.add_argument("--seed", type=seed, default=0)
    return p


def run(args: argparse.Namespace) -> dict:
    from training.predictor_ablation import run_ablation

    return run_ablation(args.trace, args.out, model_dir=args.model, val_trace_dir=args.val_trace,
                        variants=list(args.variants) if args.variants else None, max_steps=args.max_steps,
                        val_every=args.val_every, lr=args.lr, window=args.window, batch_size=args.batch_size,
                        seed=args.seed)
