"""`prescient tune`: measure on this machine the fastest configuration of a model at a few memory
sizes and keep it as the default of `generate`, `serve` and `bench --memory` (see
`offload_runtime.planning.tune`)."""

from __future__ import annotations

import argparse

from cli.args import list_of, memory, output_file, positive_int
from cli.commands import add_command
from prescient.errors import CapacityError


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = add_command(subparsers, "tune")
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--predictor", default=None, help="the predictor artifact generate and serve will use")
    p.add_argument("--memory", type=list_of(memory), default=None, metavar="SIZE,...",
                   help="memory sizes to tune at (default: 40%%, 60%% and 80%% of what the whole model needs)")
    p.add_argument("--new-tokens", type=positive_int, default=48, help="new tokens per calibration decode")
    p.add_argument("--repeats", type=positive_int, default=2, help="interleaved runs of each configuration")
    p.add_argument("--json", type=output_file, default=None, metavar="OUT",
                   help="also write the whole record (every run) here")
    return p


def run(args: argparse.Namespace) -> dict:
    from offload_runtime.planning.tune import tune
    from offload_runtime.engine.tuned import save_tuned, tuned_path
    from prescient.atomic import write_results

    def keep(record: dict) -> None:  # after each size: a stopped tuning keeps what it measured
        save_tuned(args.model, record)
        if args.json:
            write_results(record, args.json)

    record = tune(args.model, args.predictor, list(args.memory) if args.memory else None, args.new_tokens,
                  args.repeats, on_size=keep)
    for best in record["best"]:
        settings = ", ".join(f"{k}={v}" for k, v in best["settings"].items())
        low, high = best["spread"]
        print(f"{best['memory'] / 2**30:.2f} GiB: {best['tokens_per_s']:.1f} tokens/s ({low:.1f}-{high:.1f}) "
              f"with {settings}")
    for refused in record["refused"]:
        print(f"{refused['memory'] / 2**30:.2f} GiB: not run ({refused['why']})")
    if not record["best"]:
        raise nothing_measured(record["refused"])
    print(f"kept as this machine's default for {args.model}: {tuned_path(args.model)}")
    return record


def nothing_measured(refused: list[dict]) -> CapacityError:
    """The one error of a tune that measured no size: the sizes, and why the largest was refused."""
    sizes = ", ".join(f"{entry['memory'] / 2**30:.2f} GiB" for entry in refused)
    largest = max(refused, key=lambda entry: entry["memory"], default=None)
    why = f": at the largest, {largest['why']}" if largest else ""
    return CapacityError(f"tune measured nothing and kept nothing: no size ran ({sizes or 'none given'}){why}; "
                         "give --memory sizes the model can run in")
