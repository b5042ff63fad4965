"""`prescient bench-tracing`: tracing throughput against a plain forward pass of the same batches
(JSON); see `experiments.bench_tracing`."""

from __future__ import annotations

import argparse
import logging

from cli.args import add_results_args, positive_int, threads
from cli.commands import add_command

log = logging.getLogger(__name__)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = add_command(subparsers, "bench-tracing")
    p.add_argument("--model", required=True, help="Hugging Face MoE model directory")
    add_results_args(p, plot=None)
    p.add_argument("--dataset", default="stdlib-code")
    p.add_argument("--split", default="validation")
    p.add_argument("--tokens", type=positive_int, default=16_384)
    p.add_argument("--seq-len", type=positive_int, default=128)
    p.add_argument("--batch-size", type=positive_int, default=16)
    p.add_argument("--shard-sequences", type=positive_int, default=256, help="as `prescient trace`")
    p.add_argument("--top-t", type=positive_int, default=30)
    p.add_argument("--repeats", type=positive_int, default=7)
    p.add_argument("--threads", type=threads, default=None, help="torch threads (default: torch's choice)")
    return p


def run(args: argparse.Namespace) -> dict:
    import torch

    from experiments.bench_tracing import bench_tracing
    from prescient.atomic import write_results

    if args.threads:
        torch.set_num_threads(args.threads)
    result = bench_tracing(args.model, args.dataset, args.split, args.tokens, args.seq_len, args.batch_size,
                           args.shard_sequences, args.top_t, args.repeats)
    write_results(result, args.json)
    log.info("%d tokens: plain %.0f tok/s, traced %.0f tok/s, overhead %.1f%% (CPU time %.1f%%)", result["tokens"],
             result["plain_tokens_per_s"], result["traced_tokens_per_s"], result["overhead_pct"],
             result["cpu_overhead_pct"])
    return result
