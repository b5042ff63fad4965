"""`prescient`'s commands, in the order `prescient --help` lists them: each command's module of this
package and its line in that list, read without importing any command, so that `prescient --help`
answers at once (a command's module, and what it imports, loads only when that command is named)."""

from __future__ import annotations

import argparse
import copy
from typing import NoReturn

# command -> (module of this package, its line in `prescient --help`)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("demo", "run the whole pipeline on the tiny reference model"),
    "reference-model": ("reference_model", "build the project's reference MoE (tiny, base or bench)"),
    "quantize": ("quantize", "store a model's routed experts at 2, 4 or 8 bits (compressed-tensors pack-quantized) or "
                             "in bfloat16"),
    "trace": ("trace", "record router traces of an MoE model over a dataset"),
    "train": ("train", "train a predictor with LightningCLI (see configs/predictor/)"),
    "evaluate": ("evaluate", "compare expert predictors on a router trace (JSON + PNG)"),
    "routing-stats": ("routing_stats", "expert load, top-1 repeats, router entropy, gate-lookahead and token-table "
                                       "recall per layer (JSON + PNG)"),
    "quality": ("quality", "perplexity, KL and top-1 agreement of a model against its reference"),
    "compare-caches": ("compare_caches", "replay a trace through cache policies, with and without predictor prefetch "
                                         "(JSON + PNG)"),
    "generate": ("generate", "generate text with experts offloaded (greedy, or seeded sampling), print runtime stats"),
    "bench": ("bench", "decode tokens/s and memory of the offloading runtime (JSON + PNG)"),
    "bench-compressed": ("bench_compressed", "decode tokens/s of a model at several stored precisions, beside their "
                                             "quality (JSON + PNG)"),
    "bench-batch": ("bench_batch", "Klotski, CGOPipe and FlexGen's zig-zag batch decoding at one budget; Klotski's "
                                   "planner; HRM check"),
    "bench-kernels": ("bench_kernels", "load-aware expert kernels (EPS-MoE) against the model's own, in Klotski's "
                                       "batch decoder"),
    "serve": ("serve", "OpenAI-compatible server (completions, chat, streaming, /metrics) over the offloading runtime"),
    "bench-serve": ("bench_serve", "load test of prescient serve: concurrent clients, throughput, latency, time to "
                                   "first token"),
    "bench-replicas": ("bench_replicas", "expert hit rate of serving replicas by routing, multi-turn chats (Ray Serve "
                                         "or in process)"),
    "tune": ("tune", "measure the fastest configuration per memory size on this machine and keep it as the default"),
    "plan": ("plan", "choose an offloading policy with the HRM performance model"),
    "profile-hw": ("profile_hw", "measure this machine as a hardware profile for `prescient plan`"),
    "bench-simulator": ("bench_simulator", "cache simulator throughput on a synthetic trace (JSON)"),
    "bench-tracing": ("bench_tracing", "tracing overhead against plain forwards (JSON)"),
    "bench-predictor-latency": ("bench_predictor_latency", "SiDA hash function: ms per decoded token (JSON)"),
    "ablation": ("ablation", "SiDA loss-variant ablation on a trace (JSON)"),
    "archs": ("archs", "list the MoE architectures of this transformers and whether each is served exactly or refused "
                       "(builds and runs each tiny)"),
    "report": ("report", "render the results pages, the README's headline table and the command reference (docs/)"),
}


def add_command(subparsers: argparse._SubParsersAction, name: str, **kwargs) -> argparse.ArgumentParser:
    """The parser of command `name`, listed with its line from `COMMANDS`."""
    return subparsers.add_parser(name, help=COMMANDS[name][1], **kwargs)


class ShowDefaults(argparse.HelpFormatter):
    """Help that ends each flag's line with its default, unless the line already says it (a default
    that depends on other flags is said in words there) or the flag has none."""

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and _default(action) is not None:  # argparse shows help only where a flag has some
            action = copy.copy(action)
            action.help = f"default: {_default(action)}".replace("%", "%%")
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text, shown = action.help or "", _default(action)
        if shown is None or "default" in text.lower():
            return text
        return f"{text} (default: {shown.replace('%', '%%')})"


def _default(action: argparse.Action) -> str | None:
    """A flag's default as `--help` shows it; None where it has none to show."""
    value = action.default
    if (not action.option_strings or action.required or value is None or value is argparse.SUPPRESS
            or action.help is argparse.SUPPRESS):
        return None
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line: what is wrong, and where help is; its help
    shows each flag's default (`ShowDefaults`)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", ShowDefaults)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {message} (see `{self.prog} --help`)\n")
