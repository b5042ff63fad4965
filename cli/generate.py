"""`prescient generate`: greedy generation through the offloading runtime; prints the text and
the runtime statistics, and writes them as JSON with `--json`."""

from __future__ import annotations

import argparse
import logging

from cli.args import add_predictor_arg, add_runtime_args, output_file, positive_int, runtime_settings, seed
from cli.commands import add_command

log = logging.getLogger(__name__)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = add_command(subparsers, "generate")
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=positive_int, default=32)
    predictor = add_predictor_arg(p)
    sampling = p.add_argument_group("sampling", "greedy unless --sample is given")
    sampling.add_argument("--sample", type=seed, default=None, metavar="SEED",
                          help="sampled decoding seeded by SEED (default: greedy)")
    sampling.add_argument("--temperature", type=float, default=None,
                          help="with --sample: the temperature (default 1.0)")
    sampling.add_argument("--top-p", type=float, default=None, help="with --sample: nucleus sampling's mass (default 1.0)")
    add_runtime_args(p, predictor=predictor)
    diagnostics = p.add_argument_group("diagnostics")
    diagnostics.add_argument("--json", type=output_file, default=None, metavar="OUT",
                             help="write ids, text, stats and settings here (default: printed only)")
    return p


def run(args: argparse.Namespace) -> dict:
    """Generate, print, write `--json`; returns the JSON record."""
    from offload_runtime.engine.generate import GenerateRequest, GenerationError, Sampling, generate
    from offload_runtime.engine.memory_plan import MemoryPlan
    from offload_runtime.engine.resolve import LoadRequest
    from offload_runtime.engine.threads import use_decode_threads
    from prescient.atomic import write_results

    shape = {name: value for name, value in (("temperature", args.temperature), ("top_p", args.top_p))
             if value is not None}
    if shape and args.sample is None:
        raise GenerationError("--temperature and --top-p shape sampled decoding: give --sample SEED too")
    sampling = None if args.sample is None else Sampling(args.sample, **shape)
    request = GenerateRequest(LoadRequest(args.model, args.predictor, settings=runtime_settings(args)), args.prompt,
                              args.max_new_tokens, sampling)
    use_decode_threads()
    record = generate(request)
    print(record["text"])
    if record["memory_plan"] is not None:
        print(MemoryPlan(**record["memory_plan"]).line())
    print(summary(record))
    if args.json:
        write_results(record, args.json)
    return record


def summary(record: dict) -> str:
    """The runtime's statistics and the decode speed, a line each (the speed alone where every expert
    was loaded with the model: nothing was offloaded, so there is nothing else to say)."""
    s = record["stats"]
    speed = f"{record['tokens_per_s']:.1f} tokens/s" if record["tokens_per_s"] else "n/a (fewer than 2 new tokens)"
    if (record["memory_plan"] or {}).get("resident"):
        return f"decode: {speed}"
    return "\n".join([
        f"experts: {s['hits']} hits, {s['misses']} misses (hit rate {s['hit_rate']:.1%}) in {s['slots']} slots",
        f"prefetch: {s['prefetch_inserts']} inserted, accuracy {s['prefetch_accuracy']:.1%}, "
        f"{s['wasted_prefetches']} wasted",
        f"moved {s['bytes_moved'] / 2**20:.2f} MiB in {s['loads']} loads; stalled {s['stall_seconds']:.3f} s on loads",
        f"hash tables: {s['tables_on_time']} on time, {s['late_tables']} late at their first layer; layers served "
        f"by their table in time: {s['table_layers_on_time']}, late: {s['table_layers_late']}",
        f"decode: {speed}",
    ])
