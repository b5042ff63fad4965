"""The argument vocabulary every command shares: budgets with a unit, comma lists, predictor
specs. Each is an argparse `type`, so a bad value is refused in one line before any work."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import TypeVar

from cache.tiered import PRECISION_RULES
from offload_runtime.engine.options import (DTYPES, EXPERT_KERNELS, MAX_LOOKAHEAD_LAYERS, MAX_TRANSFER_WORKERS,
                                            SLOT_FORMATS, STORES, RuntimeOptions)
from prescient.atomic import check_folder, resolve_output
from prescient.budget import MEMORY_HELP, Budget, parse_memory
from prescient.devices import check_device
from prescient.errors import PrescientError

T = TypeVar("T")
log = logging.getLogger("prescient")


def _checked(check: Callable[[str], T], text: str) -> T:
    """Run a library check as part of an argparse type: its error becomes the argument's."""
    try:
        return check(text)
    except PrescientError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def budget(text: str) -> Budget:
    """`--budget 0.5` / `50%` / `12slots` / `3GiB` (see `prescient.budget`)."""
    return _checked(Budget.parse, text)


def memory(text: str) -> int:
    """`--memory 8GiB` / `1.5GB` / `25%` of this machine's memory, in bytes (see `prescient.budget`)."""
    return _checked(parse_memory, text)


def output_file(text: str) -> str:
    """A file to write results to: refused before any work when it is a directory, a FIFO or
    in a folder that cannot be written (see `prescient.atomic.resolve_output`)."""
    _checked(resolve_output, text)
    return text


def output_dir(text: str) -> str:
    """A folder to write into: refused when it names an existing file."""
    if Path(text).exists() and not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file, not a folder; name a folder to write into")
    _checked(lambda path: check_folder(Path(path), Path(path)), text)
    return text


def device(text: str) -> str:
    """`cpu`, `cuda` or `cuda:N`, present on this machine. `cpu` (the default, which argparse
    parses too) is not checked: the check imports torch, and a command under `--memory` imports
    none before its kernels are compiled (`compile_kernels_ahead`)."""
    if text != "cpu":
        _checked(check_device, text)
    return text


def serving_policy(text: str) -> str:
    """A cache policy the runtime can serve with (lru, lfu, fifo, mrs)."""
    from cache import make_serving_policy

    _checked(lambda name: make_serving_policy(name, top_k=1), text)
    return text.lower()


def _number(text: str, read: Callable[[str], T], what: str, fits: Callable[[T], bool], needs: str) -> T:
    """`text` read by `read` (else: "is not `what`") and within range by `fits` (else: `needs`)."""
    try:
        value = read(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if not fits(value):
        raise argparse.ArgumentTypeError(f"{value} {needs}")
    return value


DEFAULTS = {field.name: field.default for field in fields(RuntimeOptions)}  # each runtime flag's, where it lives
MOST = 2**63 - 1  # the largest count a 64-bit integer holds: beyond it torch and numpy overflow
MAX_THREADS = 4096


def _count(text: str, least: int) -> int:
    """A whole number from `least` to `MOST`."""
    value = _number(text, int, "a whole number", lambda v: v >= least, f"must be at least {least}")
    if value > MOST:
        shown = text.strip() if len(text.strip()) <= 24 else f"{text.strip()[:12]}... ({len(text.strip())} digits)"
        raise argparse.ArgumentTypeError(f"{shown} is too large: at most 2**63-1")
    return value


def positive_int(text: str) -> int:
    return _count(text, 1)


def non_negative_int(text: str) -> int:
    return _count(text, 0)


def seed(text: str) -> int:
    """A random seed: a whole number torch's generator takes (-2**63 to 2**64-1)."""
    return _number(text, int, "a whole number", lambda v: -2**63 <= v < 2**64,
                   "is not a seed: give a whole number from -2**63 to 2**64-1")


def threads(text: str) -> int:
    """Torch threads: 1 to `MAX_THREADS`."""
    return _number(text, int, "a whole number", lambda v: 1 <= v <= MAX_THREADS,
                   f"is not a number of threads in 1..{MAX_THREADS}")


def share(text: str) -> float:
    """A share of a whole: a number in [0, 1]."""
    return _number(text, float, "a fraction", lambda v: 0 <= v <= 1, "must lie in [0, 1]")


def lookahead_layers(text: str) -> int:
    """How many MoE layers in-token lookahead guesses ahead: 0 (off) to `MAX_LOOKAHEAD_LAYERS`."""
    return _number(text, int, "a whole number", lambda v: 0 <= v <= MAX_LOOKAHEAD_LAYERS,
                   f"is not a number of layers in 0..{MAX_LOOKAHEAD_LAYERS} (0: off)")


def transfer_workers(text: str) -> int | str:
    """Copies in flight: a whole number in 1..MAX_TRANSFER_WORKERS, or `auto` (the queue depth a
    `prescient profile-hw` JSON chose, given with --link-profile)."""
    if text.strip().lower() == "auto":
        return "auto"
    workers = positive_int(text)
    if workers > MAX_TRANSFER_WORKERS:
        raise argparse.ArgumentTypeError(f"{workers} is out of range: give 1 to {MAX_TRANSFER_WORKERS} copies in "
                                         "flight, or auto")
    return workers


def port(text: str) -> int:
    """A TCP port: a whole number in 0..65535 (0: any free port)."""
    return _number(text, int, "a port number", lambda v: 0 <= v <= 65535, "is not a port in 0..65535")


def seconds(text: str) -> float:
    """A duration: a finite number of seconds, at least 0."""
    return _number(text, float, "a number of seconds", lambda v: 0.0 <= v < float("inf"),
                   "is not a duration (a finite number of seconds, at least 0)")


def chance(text: str) -> float:
    """A chance of use: a number in [0, 1]."""
    return _number(text, float, "a number", lambda v: 0.0 <= v <= 1.0, "is not a chance in [0, 1]")


def list_of(item: Callable[[str], T]) -> Callable[[str], tuple[T, ...]]:
    """An argparse type for a non-empty comma list whose items `item` reads, each given once."""
    def parse(text: str) -> tuple[T, ...]:
        parts = [part.strip() for part in text.split(",") if part.strip()]
        items = tuple(item(part) for part in parts)
        if not items:
            raise argparse.ArgumentTypeError(f"{text!r} lists nothing; give a comma list")
        for i, value in enumerate(items):
            if value in items[:i]:
                raise argparse.ArgumentTypeError(f"{text!r} names {parts[i]!r} twice; give each once")
        return items
    parse.__name__ = f"list of {getattr(item, '__name__', 'values')}"
    return parse


budgets = list_of(budget)
positive_ints = list_of(positive_int)
names = list_of(str)


def predictor_specs(text: str) -> dict[str, str | None]:
    """`sida=PATH,corr,token` -> {"sida": "PATH", "corr": None, "token": None}: a built-in name
    (see `predictor.registry`) or NAME=ARTIFACT."""
    specs: dict[str, str | None] = {}
    for item in list_of(str)(text):
        name, _, path = item.partition("=")
        if not name:
            raise argparse.ArgumentTypeError(f"predictor entry {item!r} has no name; write NAME or NAME=ARTIFACT")
        if name.strip() in specs:
            raise argparse.ArgumentTypeError(f"predictor {name.strip()!r} is named twice; give each name once")
        specs[name.strip()] = path.strip() or None
    return specs


def named_paths(text: str) -> dict[str, str]:
    """`fp32=runs/a,int4=runs/b` -> {"fp32": "runs/a", "int4": "runs/b"}, in order, each name once."""
    pairs: dict[str, str] = {}
    for item in list_of(str)(text):
        name, _, path = (part.strip() for part in item.partition("="))
        if not name or not path:
            raise argparse.ArgumentTypeError(f"entry {item!r} is not NAME=PATH")
        if name in pairs:
            raise argparse.ArgumentTypeError(f"{name!r} is named twice; give each name once")
        pairs[name] = path
    return pairs


def add_results_args(parser: argparse.ArgumentParser, what: str = "results file", plot: str | None = "PNG of the results"
                     ) -> None:
    """`--json OUT` (required) and, unless `plot` is None, `--plot OUT.png`: an experiment's outputs."""
    parser.add_argument("--json", required=True, type=output_file, metavar="OUT", help=what)
    if plot is not None:
        parser.add_argument("--plot", type=output_file, metavar="OUT.png", help=plot)


class Renamed(argparse.Action):
    """Stores the value; a use under the old name (`deprecated`) also logs a warning naming the new one."""

    def __init__(self, *args, deprecated: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.deprecated = deprecated

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if option_string == self.deprecated:
            log.warning("%s is deprecated; write %s", self.deprecated, self.option_strings[0])
        setattr(namespace, self.dest, values)


def _runtime_flags() -> dict[str, Callable[[argparse.ArgumentParser], object]]:
    """Each runtime option's flags, by the `RuntimeOptions` field (or prefetch switch) they set, in
    the order `--help` lists them."""
    return {**_where_flags(), **_precision_flags(), **_read_flags(), **_compute_flags()}


def _where_flags() -> dict[str, Callable[[argparse.ArgumentParser], object]]:
    """The policy and where the experts live: memory or budget, store, device."""
    return {
        "policy": lambda p: p.add_argument(
            "--policy", type=serving_policy, default=None,
            help="cache policy: lru, lfu, fifo, mrs, learned, learned-belady (default: the best measured, "
                 "learned-belady with a --predictor that has forecast heads: with 8 of them 1.33x LRU at half the "
                 "experts, results/bench-runtime-base-sampled.json; with the demo's 2, a median 1.06x the runtime "
                 "without a predictor at 0.66 GB, results/bench-prediction-tb-guard2.json; lru otherwise)"),
        "memory": lambda p: p.add_argument(
            "--memory", type=memory, default=None, metavar="SIZE",
            help=f"the whole process's memory ({MEMORY_HELP.replace('%', '%%')}): slots are sized to fit beside "
                 "the rest; where every expert fits beside the process and the library pages it runs, the plain "
                 "model (its own forward, no hooks); --map-experts: the weights mapped from the checkpoint; the "
                 "configuration is printed in one line (default: none, --budget sizes the slots)"),
        "budget": lambda p: p.add_argument(
            "--budget", type=budget, default=None,
            help="instead of --memory, the experts' slots alone: a fraction of all experts (0.5 or 50%%), slots "
                 "(12slots) or bytes (512MiB) (default: 50%% when neither is given)"),
        "store": lambda p: p.add_argument("--store", choices=STORES, default=DEFAULTS["store"],
                                          help="where the experts live"),
        "drop_page_cache": lambda p: p.add_argument(
            "--drop-page-cache", action="store_true", help="disk store: drop read pages from the page cache"),
        "device": lambda p: p.add_argument("--device", type=device, default=DEFAULTS["device"],
                                          help="where the slots and the resident weights live"),
    }


def _precision_flags() -> dict[str, Callable[[argparse.ArgumentParser], object]]:
    """What a slot holds: the compute dtype, packed or expanded, mixed precision."""
    return {
        "dtype": lambda p: p.add_argument(
            "--dtype", choices=DTYPES, default=DEFAULTS["dtype"],
            help="what the model computes in and a slot holds (bfloat16: half the bytes per expert slot)"),
        "slot_format": lambda p: p.add_argument(
            "--slot-format", choices=SLOT_FORMATS, default=DEFAULTS["slot_format"],
            help="expanded: a slot holds an expert in --dtype whatever its stored precision; packed: int4 (int8) "
                 "experts stay int4 (int8) in their slots, ~3.5x (2x) more per byte than bf16, computed by torch's "
                 "weight-only CPU kernels (needs --dtype bfloat16)"),
        "fine_model": lambda p: p.add_argument(
            "--fine-model", metavar="DIR",
            help="mixed precision: the same model with experts stored finer (e.g. prescient quantize --bits 8 "
                 "--group-size channel beside --bits 4); each expert loaded takes its fine or its coarse copy by "
                 "--precision-rule (needs --slot-format packed; default: none, one precision)"),
        "fine_share": lambda p: p.add_argument(
            "--fine-share", type=float, default=DEFAULTS["fine_share"],
            help="with --fine-model: the budget's share in fine slots"),
        "precision_rule": lambda p: p.add_argument(
            "--precision-rule", choices=PRECISION_RULES, default=DEFAULTS["precision_rule"],
            help="with --fine-model: which experts get the fine copy: router (its router weight; the best on the "
                 "bench), forecast (the predictor's chance that coming tokens use it; needs a --predictor with "
                 "forecast heads), hotness (its use count so far)"),
    }


def _read_flags() -> dict[str, Callable[[argparse.ArgumentParser], object]]:
    """How experts are read: transfer workers, read depth, hide-only prefetch."""
    return {
        "transfer_workers": lambda p: (p.add_argument(
            "--transfer-workers", type=transfer_workers, default=None,
            help="expert copies that run at once (reads in flight); auto: the queue depth that --link-profile chose "
                 "(default: tuned with --memory, else 1)"),
            p.add_argument("--link-profile", metavar="PROFILE.json",
                           help="with --transfer-workers auto: a `prescient profile-hw --model DIR` JSON whose random-"
                                "read curve chose the queue depth (default: none)")),
        "read_depth": lambda p: p.add_argument(
            "--read-depth", type=positive_int, default=None, metavar="N",
            help="disk store: each expert read split into N reads in flight at once, the queue depth the device "
                 "needs for its rate, with no extra buffer (default: tuned with --memory, else 1)"),
        "hide_only": lambda p: p.add_argument(
            "--hide-only", metavar="BENCH.json|PROFILE.json",
            help="prefetch an expert only if the link can move it before its layer runs, the link calibrated from a "
                 "`prescient bench` JSON or a `prescient profile-hw` JSON (default: prefetch as many as the slots "
                 "allow)"),
    }


def _compute_flags() -> dict[str, Callable[[argparse.ArgumentParser], object]]:
    """How experts are computed and prefetched within and across tokens: the pipeline, kernels,
    lookahead, mapping, the hybrid schedule, cross-token prefetch."""
    return {
        "expert_pipeline": lambda p: p.add_argument(
            "--expert-pipeline", action=argparse.BooleanOptionalAction, default=None,
            help="a layer's resident experts compute while its misses are copied, then each miss as it "
                 "lands (default: tuned with --memory, else on); --no-expert-pipeline: the layer waits for all its copies first"),
        "expert_kernel": lambda p: (p.add_argument(
            "--expert-kernel", choices=EXPERT_KERNELS, default=DEFAULTS["expert_kernel"],
            help="how experts compute: gemv (where the model runs grouped_mm on the CPU, each routed expert's GEMM "
                 "from its weights, a decode row of float32 weights of 1 MiB or more through our row kernel, a dot "
                 "product per row at the memory bus's rate; logits within 1e-5 of transformers' kernel); streamed "
                 "(the same without the row kernel, bit for bit); model (the model's own experts implementation, for "
                 "bit-for-bit comparisons); auto (EPS-MoE's: per layer and call, the kernel measured fastest for its "
                 "tokens per expert, and no per-expert pipeline below the measured load); or one of transformers' "
                 "eager, batched_mm, grouped_mm"),
            p.add_argument("--expert-kernel-table", metavar="TABLE.json",
                           help="with --expert-kernel auto: a `prescient bench-kernels` JSON whose crossover picks the "
                                "kernels (default: measured on the model's layer shape at load)")),
        "lookahead_layers": lambda p: p.add_argument(
            "--lookahead", dest="lookahead_layers", type=lookahead_layers, default=None, metavar="LAYERS",
            help="in-token lookahead (after HybriMoE): when a MoE block starts, the routers of the next 1-3 layers on its "
                 "input pick experts to prefetch (default: tuned with --memory, else 0: off)"),
        "lookahead_probe": lambda p: p.add_argument(
            "--lookahead-probe", metavar="PROBE",
            help="in-token lookahead (--lookahead N, 1 if not given) with a trained probe artifact guessing the next "
                 "layers' experts from each block's input instead of their routers (prescient train --config "
                 "configs/predictor/probe.yaml; default: none, the routers guess)"),
        "map_experts": lambda p: p.add_argument(
            "--map-experts", action=argparse.BooleanOptionalAction, default=None,
            help="with --memory: every weight a view of the memory-mapped checkpoint, the kernel's page cache the "
                 "experts' cache (no slots, no predictor), whatever the cap; --no-map-experts: never (default: tuned "
                 "with --memory, else copied into memory where every expert fits, slots below: at runs/tb's 1100 MiB "
                 "slots decoded 137-221 tok/s where the mapped model ran 82-105, results/bench-memory-tb-parity-slots"
                 ".json and -mapped.json)"),
        "hybrid_schedule": lambda p: p.add_argument(
            "--hybrid-schedule", action=argparse.BooleanOptionalAction, default=None,
            help="HybriMoE's scheduler: with --device cuda --store host, each layer's misses split between copying to "
                 "the GPU and computing on the CPU by measured costs; on a CPU-only host, a miss predicted to be reused "
                 "later than every resident expert computes from a scratch buffer without evicting (default: off)"),
        "next_token": lambda p: p.add_argument(
            "--next-token", action=argparse.BooleanOptionalAction, default=None,
            help="cross-token prefetch: load the next token's likely experts while this token's layers compute "
                 "(needs a --predictor with forecast heads; default: tuned with --memory, else off)"),
    }


RUNTIME_FLAGS = tuple(_runtime_flags())
USER_FLAGS = ("memory", "device", "dtype")  # what a user names, beside the model; the rest are overrides
PREDICTOR_FLAGS = ("next_token", "lookahead_layers", "lookahead_probe", "hide_only")  # what guesses ahead decide


def add_predictor_arg(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """`--predictor` leading a group of its own, which `add_runtime_args` fills with the flags that
    act on the predictor's guesses; made before the command's other groups, so `--help` shows it
    after the model, prompt and memory."""
    group = p.add_argument_group("predictor", "what guesses the coming experts, and what the runtime does with its "
                                              "guesses (each flag but --predictor overrides what --memory chooses)")
    group.add_argument("--predictor", default=None,
                       help="predictor artifact (NAME, NAME.json or NAME.safetensors) (default: none, each expert "
                            "loaded when its router picks it)")
    return group


def add_runtime_args(p: argparse.ArgumentParser, *which: str,
                     predictor: argparse._ArgumentGroup | None = None) -> argparse._ArgumentGroup:
    """The flags of the runtime's options (`RuntimeOptions`, built by `runtime_options`): all of
    them, or those named in `which` (a command that sets the others itself, e.g. per run), on `p`.
    With all of them, the memory, device and dtype go on `p`, the flags acting on the predictor's
    guesses in `predictor` (`add_predictor_arg`'s group), the rest in a tuning group made here;
    returns that group (or `p`), where a command adds its own tuning flags."""
    flags, names = _runtime_flags(), which or RUNTIME_FLAGS
    tuning = p.add_argument_group(
        "expert cache and runtime tuning", "each sets one part of the configuration that --memory (or --budget) "
                                           "chooses; leave them to run the defaults") if not which else p
    guesses = predictor if predictor is not None else tuning
    if predictor is not None:  # its group lists them in their own order
        names = (*(name for name in PREDICTOR_FLAGS if name in names), *(n for n in names if n not in PREDICTOR_FLAGS))
    for name in names:
        group = p if name in USER_FLAGS else guesses if name in PREDICTOR_FLAGS else tuning
        flags[name](group)
        if name == "next_token":
            add_next_token_min_chance(group, "with --next-token")
    p.set_defaults(runtime_flags=names)  # what `runtime_options` reads
    return tuning


def add_next_token_min_chance(p: argparse.ArgumentParser, applies: str) -> None:
    """`--next-token-min-chance`, the one threshold of cross-token prefetch (`--next-min-chance`
    is its old name, still read); `applies` says when it is read."""
    p.add_argument("--next-token-min-chance", "--next-min-chance", type=chance, default=0.5,
                   action=Renamed, deprecated="--next-min-chance",
                   help=f"{applies}: prefetch a next-token expert only if its forecast chance of use is at least "
                        "this (default 0.5)")


def runtime_settings(args: argparse.Namespace, **fields: object) -> dict[str, object]:
    """A command's runtime settings as values: the flags from `add_runtime_args` that were named
    (None: not named), what their files say (`--hide-only`'s link timing, `--link-profile`'s queue
    depth), and `fields` the command sets itself; the engine resolves them (`resolve_options`)."""
    names = set(args.runtime_flags)
    flags = {name: getattr(args, name) for name in names & RuntimeOptions.names()}
    flags = {name: value for name, value in flags.items() if value is not None}  # None: not named
    if "hide_only" in names and args.hide_only:
        from experiments.timing_calibration import load_timing

        flags["link_timing"] = load_timing(args.hide_only, model_config=args.model).timing
    if "transfer_workers" in names and args.transfer_workers == "auto":
        from offload_runtime.planning.link_profile import profiled_depth

        flags["transfer_workers"] = profiled_depth(args.link_profile)
    if "expert_kernel" in names:
        flags["expert_kernel_table"] = args.expert_kernel_table
    if "next_token" in names and args.next_token is not None:
        flags["next_token_min_chance"] = args.next_token_min_chance if args.next_token else None
    return {**flags, **fields}


def compile_kernels_ahead(args: argparse.Namespace, restartable: bool) -> None:
    """Under a command's `--memory`, before it imports torch: the runtime's compiled kernels that
    numba's on-disk cache lacks compiled by child processes while this one holds neither torch nor
    the model, or, where this process runs the command alone (`restartable`) and loads the model
    itself before it serves anything, left to the loader, which checks the plan first and starts
    the command again to compile what the run calls (`offload_runtime.engine.compiled.prepare_command`;
    called before the command runs)."""
    if "memory" not in getattr(args, "runtime_flags", ()) or args.memory is None:
        return
    from offload_runtime.engine.compiled import prepare_command

    # replicas load in other processes; `serve` loads after its server binds the port, which a command started
    # again would find still held by its first self ("address already in use")
    prepare_command(restartable and getattr(args, "replicas", None) is None and args.command != "serve")


def runtime_options(args: argparse.Namespace, **fields: object) -> RuntimeOptions:
    """The one `RuntimeOptions` of a command: `runtime_settings` resolved by `resolve_options` (over,
    with `--memory`, the configuration `prescient tune` measured best for the model on this machine,
    the best measured policy and the built-in defaults)."""
    from offload_runtime.engine.resolve import resolve_options  # imports torch, which `--help` does without

    return resolve_options(getattr(args, "model", None), getattr(args, "predictor", None),
                           runtime_settings(args, **fields))
