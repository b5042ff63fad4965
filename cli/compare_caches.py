"""`prescient compare-caches`: cache policies replayed on a router trace, with and without
predictor prefetch (JSON + PNG); see `experiments.compare_caches`."""

from __future__ import annotations

import argparse

from cli.args import (Renamed, add_next_token_min_chance, add_results_args, budgets, names, positive_int,
                      positive_ints)
from cli.commands import add_command
from prescient.errors import TraceError
from prescient.predictor_names import NAMES_HELP

PIPELINES = {"on": (True,), "off": (False,), "both": (True, False)}
POLICIES_HELP = "lru, lfu, fifo, mrs, static, belady, learned (needs a --predictor with forecast heads), learned-belady"


def layers_ahead(text: str) -> int | None:
    return None if text.strip().lower() == "all" else positive_int(text)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = add_command(subparsers, "compare-caches")
    p.add_argument("--trace", required=True, help="router trace to replay (held-out split)")
    p.add_argument("--predictor", help=f"prefetch with a predictor artifact PATH or one of {NAMES_HELP}")
    p.add_argument("--train-trace", help="trace the named predictors and static-hot are fit on (default: --trace)")
    p.add_argument("--policies", type=names, default="lru,lfu,fifo,mrs,static,belady",
                   help=f"comma list of {POLICIES_HELP}")
    p.add_argument("--capacity", type=budgets, default="0.125,0.25,0.5,0.75",
                   help="comma list of fractions of all L*E experts (0.25 or 25%%) or slot counts (48slots)")
    p.add_argument("--batch-size", type=positive_ints, default="1,8", help="comma list of batch sizes")
    p.add_argument("--layers-ahead", "--horizon", type=layers_ahead, default="1", action=Renamed,
                   deprecated="--horizon",
                   help="prefetch this many layers ahead, or 'all' (at the token's start); --horizon is its old name")
    p.add_argument("--transfer-per-step", type=int, default=None,
                   help="experts the link moves per layer compute (default: transfers are instant)")
    p.add_argument("--timing", metavar="BENCH.json|PROFILE.json",
                   help="time-true link: calibrated from a `prescient bench` JSON, or a `prescient profile-hw` JSON "
                        "or preset with --model-config (default: count-only)")
    p.add_argument("--model-config", help="the model's config.json or directory, for --timing PROFILE")
    p.add_argument("--hide-only", action="store_true",
                   help="with --timing: prefetch an expert only if the link can move it before its layer runs")
    p.add_argument("--expert-pipeline", choices=tuple(PIPELINES), default="on",
                   help="with --timing: on (default, as the runtime): a layer's resident experts compute while its "
                        "misses are copied, then each as it lands; off: a layer computes once all its "
                        "experts are in; both: every run simulated each way (the table and plot show on)")
    p.add_argument("--next-token", action="store_true",
                   help="with --timing and a --predictor with forecast heads: cross-token prefetch, the next token's "
                        "layers prefetched from its forecast while this token's layers compute (--layers-ahead all: a "
                        "whole token ahead)")
    add_next_token_min_chance(p, "with --next-token")
    p.add_argument("--prefetch-k", type=positive_int, default=None,
                   help="predicted experts prefetched per row and layer (default: the model's top-k)")
    add_results_args(p, plot="PNG of hit and stall rates against capacity")
    return p


def run(args: argparse.Namespace) -> None:
    from experiments.compare_caches import compare_caches, format_table, plot_compare_caches
    from prescient.atomic import write_results

    from prescient.traces import read_manifest

    manifest = read_manifest(args.trace)  # None: compare_caches names the missing trace
    if manifest is not None:
        _check_batch_sizes(args.batch_size, args.trace, manifest.n_tokens)
    calibration = None
    if args.timing:
        from experiments.timing_calibration import load_timing

        calibration = load_timing(args.timing, model_config=args.model_config,
                                  fingerprint=manifest.fingerprint if manifest else None)
    result = compare_caches(args.trace, args.policies, args.capacity, args.batch_size, args.predictor,
                            args.train_trace, args.layers_ahead, args.transfer_per_step, args.prefetch_k,
                            timing=calibration and calibration.timing, hide_only=args.hide_only,
                            next_token=args.next_token, next_token_min_chance=args.next_token_min_chance,
                            expert_pipelines=PIPELINES[args.expert_pipeline])
    if calibration is not None:
        result["timing_calibration"] = calibration.to_dict()
    print(format_table(result))
    write_results(result, args.json, args.plot, plot_compare_caches)


def _check_batch_sizes(batch_sizes: tuple[int, ...], trace: str, tokens: int) -> None:
    """A batch steps that many sequences together: more than the trace has tokens steps nothing more
    and would only size the simulator's arrays past any memory."""
    too_many = [size for size in batch_sizes if size > max(tokens, 1)]
    if too_many:
        raise TraceError(f"--batch-size {too_many[0]} is more sequences than trace {trace} has tokens ({tokens}); "
                         f"give batch sizes up to {max(tokens, 1)}")
