"""prescient: learned expert prediction and caching for offloaded MoE inference.

Each command is a module of this package with `add_parser(subparsers)` and `run(args)`;
`prescient train` hands its arguments to LightningCLI, which parses its own YAML.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from cli.args import Parser
from prescient.errors import PrescientError

log = logging.getLogger("prescient")

# command -> module of this package, in the order `prescient --help` lists them
COMMANDS = {
    "demo": "demo",
    "reference-model": "reference_model",
    "quantize": "quantize",
    "trace": "trace",
    "train": "train",
    "evaluate": "evaluate",
    "routing-stats": "routing_stats",
    "quality": "quality",
    "compare-caches": "compare_caches",
    "generate": "generate",
    "bench": "bench",
    "bench-compressed": "bench_compressed",
    "bench-batch": "bench_batch",
    "serve": "serve",
    "bench-serve": "bench_serve",
    "plan": "plan",
    "profile-hw": "profile_hw",
    "bench-simulator": "bench_simulator",
    "bench-tracing": "bench_tracing",
    "bench-predictor-latency": "bench_predictor_latency",
    "ablation": "ablation",
    "archs": "archs",
}


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, object]]:
    """The parser of every command, and each command's module."""
    parser = Parser(prog="prescient", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    modules = {}
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(f"cli.{module_name}")
        module.add_parser(sub)
        modules[name] = module
    return parser, modules


def run_command(argv: list[str]) -> None:
    """Parse and run one `prescient` command (what `main` does, minus exit-code handling)."""
    if argv and argv[0] == "train":  # LightningCLI parses its own arguments
        from cli.train import run_train

        run_train(argv[1:])
        return
    parser, modules = build_parser()
    args = parser.parse_args(argv)
    modules[args.command].run(args)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        run_command(list(sys.argv[1:] if argv is None else argv))
    except PrescientError as exc:
        log.error("error: %s", " ".join(str(exc).split()))  # one line, whatever the message holds
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        log.error("interrupted")
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
