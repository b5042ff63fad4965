"""`prescient reference-model`: build the project's own MoE (no model hub is reachable here)."""

from __future__ import annotations

import argparse

from cli.args import output_dir


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("reference-model", help="build the project's reference MoE (tiny or bench)")
    p.add_argument("--size", choices=("tiny", "bench"), default="tiny")
    p.add_argument("--out", type=output_dir, default=None, help="model directory (default: runs/reference-SIZE)")
    return p


def run(args: argparse.Namespace) -> None:
    from training.reference_model import build_reference_model

    out = build_reference_model(args.size, args.out)
    print(f"reference model ({args.size}) in {out}")
