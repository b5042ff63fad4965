"""The `prescient` command: one subcommand per job.

`prescient train` hands its arguments to LightningCLI, which parses its own YAML; every
other subcommand is a small argparse front to a library function.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

from prescient.errors import PrescientError

log = logging.getLogger("prescient")

Command = Callable[[argparse.Namespace], None]


def _reference_model(args: argparse.Namespace) -> None:
    from training.reference_model import build_reference_model

    out = build_reference_model(args.size, args.out)
    print(f"reference model ({args.size}) in {out}")


def _trace(args: argparse.Namespace) -> None:
    from training.tracing import trace_model

    out = trace_model(args.model, args.dataset, args.out, split=args.split, max_tokens=args.max_tokens,
                      top_t=args.top_t, text_field=args.text_field, seq_len=args.seq_len, batch_size=args.batch_size)
    print(f"trace written to {out}")


def _demo(args: argparse.Namespace) -> None:
    from experiments.demo import run_demo

    run_demo(args.out)


def _add_parsers(sub: argparse._SubParsersAction) -> dict[str, Command]:
    p = sub.add_parser("reference-model", help="build the project's reference MoE (tiny or bench)")
    p.add_argument("--size", choices=("tiny", "bench"), default="tiny")
    p.add_argument("--out", default=None, help="model directory (default: runs/reference-SIZE)")

    p = sub.add_parser("trace", help="record router traces of an MoE model over a dataset")
    p.add_argument("--model", required=True, help="Hugging Face model directory (or hub name)")
    p.add_argument("--dataset", required=True, help="stdlib-code, stdlib-docs, json:PATH, text:PATH, or a hub name")
    p.add_argument("--split", default="validation", choices=("train", "validation", "test"))
    p.add_argument("--max-tokens", type=int, default=50_000)
    p.add_argument("--top-t", type=int, default=30, help="router logits kept per token and layer")
    p.add_argument("--text-field", default="text")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per traced window")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--out", required=True)

    p = sub.add_parser("demo", help="run the whole pipeline on the tiny reference model")
    p.add_argument("--out", default="runs/demo")

    sub.add_parser("train", help="train a predictor with LightningCLI (see configs/predictor/)", add_help=False)
    commands = {"reference-model": _reference_model, "trace": _trace, "demo": _demo}
    for module in _command_modules():
        commands[module.add_parser(sub).prog.split()[-1]] = module.run
    return commands


def _command_modules() -> list:
    """Subcommands that live beside the code they run: each has add_parser(sub) and run(args)."""
    from experiments import bench_batch, bench_runtime, compare_caches, evaluate
    from offload_runtime import generate_cli, plan_cli, profile_hw_cli

    return [evaluate, compare_caches, generate_cli, bench_runtime, bench_batch, plan_cli, profile_hw_cli]


def run_command(argv: list[str]) -> None:
    """Parse and run one `prescient` command (what `main` does, minus exit-code handling)."""
    if argv and argv[0] == "train":
        from training.predictor_cli import main as train_main

        train_main(argv[1:])
        return
    parser = argparse.ArgumentParser(prog="prescient", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    commands = _add_parsers(sub)
    args = parser.parse_args(argv)
    commands[args.command](args)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        run_command(list(sys.argv[1:] if argv is None else argv))
    except PrescientError as exc:
        log.error("error: %s", exc)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        log.error("interrupted")
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
