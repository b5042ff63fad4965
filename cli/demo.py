"""`prescient demo`: the whole pipeline on the tiny reference model, every result under one folder."""

from __future__ import annotations

import argparse

from cli.args import output_dir
from cli.commands import add_command


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = add_command(subparsers, "demo")
    p.add_argument("--out", type=output_dir, default="runs/demo",
                   help="folder of every result; a second run reuses what is there")
    return p


def run(args: argparse.Namespace) -> None:
    from experiments.demo import run_demo

    run_demo(args.out)
