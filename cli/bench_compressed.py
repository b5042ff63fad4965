"""`prescient bench-compressed`: decode speed of one model at several stored precisions, interleaved
with repeats, beside each one's quality (JSON + PNG); see `experiments.bench_compressed`."""

from __future__ import annotations

import argparse

from cli.args import (add_results_args, add_runtime_args, budgets, named_paths, names, positive_int, seed, serving_policy,
                      threads)
from cli.commands import add_command


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = add_command(subparsers, "bench-compressed")
    p.add_argument("--models", type=named_paths, required=True,
                   help="NAME=DIR,... in the order compared; the first is the uncompressed one speeds are "
                        "divided by (e.g. bf16=runs/bench-w16,int4=runs/bench-w4; a directory may appear twice)")
    p.add_argument("--packed", type=names, default=(),
                   help="NAME,... of --models whose experts stay compressed in their slots (--slot-format packed; "
                        "needs --dtype bfloat16)")
    p.add_argument("--mixed", type=mixed_entries, default={},
                   help="NAME=COARSE+FINE:RULE,...: mixed precision, the --packed model COARSE with FINE's copies "
                        "beside it, RULE (forecast, router, hotness) picking each loaded expert's copy; e.g. "
                        "mix=int4-packed+int8c-packed:forecast")
    p.add_argument("--fine-share", type=float, default=0.25, help="with --mixed: the budget's share in fine slots")
    p.add_argument("--predictor", type=named_paths, default={},
                   help="NAME=ARTIFACT: beside on-demand LRU, each budget also runs this predictor with --policy")
    p.add_argument("--policy", type=serving_policy, default="mrs", help="the policy the --predictor runs with")
    p.add_argument("--budgets", type=budgets, default="12.5%,25%,50%",
                   help="expert memory: shares of the bytes the first model's experts take in slots; every model "
                        "gets those bytes")
    p.add_argument("--modes", type=run_modes, default=((),),
                   help="every run once per comma item, each a +-joined set of `prescient bench` run modes or "
                        "'base' for none (e.g. base,serial,look: the expert pipeline on, off, and with in-token "
                        "lookahead)")
    p.add_argument("--repeats", type=positive_int, default=3, help="interleaved repeats (A B C A B C)")
    p.add_argument("--quality", type=named_paths, default={},
                   help="NAME=JSON,... `prescient quality` results shown beside NAME's runs")
    p.add_argument("--new-tokens", type=positive_int, default=24, help="new tokens per timed prompt")
    p.add_argument("--prompts", type=positive_int, default=3, help="timed prompts (one more is the warm-up)")
    p.add_argument("--sample", type=seed, default=0, metavar="SEED",
                   help="sampled decoding seeded per prompt by SEED (as `prescient bench --sample`)")
    p.add_argument("--threads", type=threads, default=1, help="torch threads per run")
    add_runtime_args(p, "dtype")  # every model alike; --packed sets each model's slot format
    p.add_argument("--dataset", default="stdlib-code", help="corpus the prompts come from")
    add_results_args(p)
    return p


def mixed_entries(text: str) -> dict[str, tuple[str, str, str]]:
    """`NAME=COARSE+FINE:RULE,...` → {NAME: (COARSE, FINE, RULE)}."""
    from cache.tiered import PRECISION_RULES

    entries = {}
    for item in names(text):
        name, _, spec = item.partition("=")
        models, _, rule = spec.partition(":")
        coarse, _, fine = models.partition("+")
        if not (name and coarse and fine and rule in PRECISION_RULES):
            raise argparse.ArgumentTypeError(f"cannot read mixed entry {item!r}; write NAME=COARSE+FINE:RULE with "
                                             f"RULE one of {', '.join(PRECISION_RULES)}")
        entries[name] = (coarse, fine, rule)
    return entries


def run_modes(text: str) -> tuple[tuple[str, ...], ...]:
    """`base,serial,look+serial` → ((), ("serial",), ("look", "serial")), checked against the bench's modes."""
    from experiments.bench_runtime.grid import RUN_MODES, PREFETCH_MODES

    sets = []
    for item in names(text):
        chosen = () if item == "base" else tuple(item.split("+"))
        if any(mode not in RUN_MODES or mode in PREFETCH_MODES for mode in chosen):
            raise argparse.ArgumentTypeError(f"{item!r}: modes are 'base' or +-joined of "
                                             f"{', '.join(m for m in RUN_MODES if m not in PREFETCH_MODES)}")
        sets.append(tuple(m for m in RUN_MODES if m in chosen))
    return tuple(sets)


def run(args: argparse.Namespace) -> None:
    from experiments.bench_compressed import bench_compressed
    from experiments.bench_runtime.grid import BenchError, fraction
    from offload_runtime.engine.resolve import resolve_options
    from training.corpora import load_corpus

    unknown = sorted(set(args.quality) - set(args.models) - set(args.mixed))
    if unknown:
        raise BenchError(f"--quality names {', '.join(unknown)}, which --models does not; name models of --models")
    texts = list(load_corpus(args.dataset, "validation")["text"][: 20 * (args.prompts + 1)])
    result = bench_compressed(args.models, texts, [fraction(b) for b in args.budgets], args.repeats, args.quality,
                              args.json, args.plot, new_tokens=args.new_tokens, timed_prompts=args.prompts,
                              options=resolve_options(None, None, {"drop_page_cache": True, "dtype": args.dtype}),
                              packed=args.packed,
                              predictor=(*next(iter(args.predictor.items())), args.policy) if args.predictor else None,
                              mixed=args.mixed, fine_share=args.fine_share, modes=args.modes,
                              sample_seed=args.sample, threads=args.threads)
    for name, rows in result["summary"].items():
        for label, row in rows.items():
            print(f"{name:<14} {label:<18} {row['tokens_per_s'] or 0:7.2f} tok/s  "
                  f"stall {row['stall_ms_per_token'] or 0:6.1f} ms/tok  {row['mb_moved_per_token'] or 0:6.1f} MB/tok  "
                  f"exact {row['exact']}")
