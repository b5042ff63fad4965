"""`prescient reference-model`: build the project's own MoE (no model hub is reachable here)."""

from __future__ import annotations

import argparse

from cli.args import output_dir
from cli.commands import add_command


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = add_command(subparsers, "reference-model")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--size", choices=("tiny", "base", "bench"), default="tiny",
                        help="a shipped recipe (configs/reference/SIZE.yaml): tiny for the demo, base for "
                             "benchmarks and quality, bench = base with widened experts")
    source.add_argument("--recipe", metavar="YAML", help="a recipe file of your own, in the shipped recipes' fields")
    p.add_argument("--out", type=output_dir, default=None, help="model directory (default: runs/reference-NAME)")
    return p


def run(args: argparse.Namespace) -> None:
    from training.reference_model import build_reference_model

    out = build_reference_model(args.size, args.out, recipe_file=args.recipe)
    print(f"reference model ({args.recipe or args.size}) in {out}")
