"""`prescient train`: a predictor trained with LightningCLI, which parses its own arguments
(`--config configs/predictor/sida.yaml --data.trace_dir DIR [--export NAME]`; see
`training.predictor_cli`)."""

from __future__ import annotations

import argparse

from cli.commands import add_command


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    # listed for `prescient --help`; `cli.main` hands train's arguments to LightningCLI unparsed
    return add_command(subparsers, "train", add_help=False)


def run_train(argv: list[str]) -> None:
    from training.predictor_cli import main

    main(argv)


def run(args: argparse.Namespace) -> None:
    run_train([])
