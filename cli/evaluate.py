"""`prescient evaluate`: compare expert predictors on a router trace (JSON + PNG); see
`experiments.evaluate` for the metrics and the JSON."""

from __future__ import annotations

import argparse

from cli.args import add_results_args, positive_int, positive_ints, predictor_specs
from cli.commands import add_command
from prescient.predictor_names import NAMES_HELP


def cross_spec(text: str) -> tuple[dict[str, tuple[str, str]], dict[str, str]]:
    """`code=TRAIN:EVAL:ARTIFACT,docs=...` -> (traces, predictor paths) for `cross_dataset`."""
    traces, artifacts = {}, {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, paths = item.partition("=")
        parts = paths.split(":")
        if not name or len(parts) != 3 or not all(parts):
            raise argparse.ArgumentTypeError(f"entry {item!r} is not DATASET=TRAIN_TRACE:EVAL_TRACE:ARTIFACT")
        traces[name], artifacts[name] = (parts[0], parts[1]), parts[2]
    if not traces:
        raise argparse.ArgumentTypeError(f"{text!r} names no DATASET=TRAIN_TRACE:EVAL_TRACE:ARTIFACT")
    return traces, artifacts


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = add_command(subparsers, "evaluate")
    p.add_argument("--trace", help="trace to evaluate on (held-out split)")
    p.add_argument("--train-trace", help="trace the freq/token/corr baselines are fit on (default: --trace)")
    p.add_argument("--model", help="model directory; needed by lookahead and checked by --cross")
    p.add_argument("--predictors", type=predictor_specs, default="freq,token,corr,oracle",
                   help=f"comma list of {NAMES_HELP}, or NAME=ARTIFACT (e.g. sida=runs/sida)")
    p.add_argument("--ahead", type=positive_int, default=3,
                   help="in-token lookahead (lookahead, probes) reported 1..N MoE layers ahead")
    p.add_argument("--batch-sizes", type=positive_ints, default="1,8,32", help="for batch precision/recall")
    p.add_argument("--cross", type=cross_spec,
                   help="DATASET=TRAIN_TRACE:EVAL_TRACE:ARTIFACT,... : cross-dataset recall matrix")
    add_results_args(p)
    return p


def run(args: argparse.Namespace) -> None:
    from experiments.evaluate import EvaluationError, cross_dataset, evaluate_predictors
    from experiments.evaluate_plot import plot_evaluation
    from prescient.atomic import write_results

    if not args.trace and not args.cross:
        raise EvaluationError("nothing to evaluate: pass --trace DIR, --cross ..., or both")
    result = {}
    if args.trace:
        result = evaluate_predictors(args.trace, args.predictors, args.model, args.train_trace, args.batch_sizes,
                                     args.ahead)
    if args.cross:
        result["cross_dataset"] = cross_dataset(args.model, *args.cross)
    write_results(result, args.json, args.plot, plot_evaluation)
