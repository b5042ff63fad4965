"""`prescient trace`: router traces of any transformers MoE model over a dataset, the model whole
or (with `--memory` / `--budget`) through the offloading runtime, whose routing is the same."""

from __future__ import annotations

import argparse
import logging
from contextlib import nullcontext

from cli.args import add_runtime_args, output_dir, positive_int, runtime_options
from cli.commands import add_command

log = logging.getLogger(__name__)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = add_command(subparsers, "trace")
    p.add_argument("--model", required=True, help="Hugging Face model directory (or hub name)")
    p.add_argument("--dataset", required=True, help="stdlib-code, stdlib-docs, json:PATH, text:PATH, or a hub name")
    p.add_argument("--split", default="validation", choices=("train", "validation", "test"))
    p.add_argument("--max-tokens", type=positive_int, default=50_000)
    p.add_argument("--top-t", type=positive_int, default=30, help="router logits kept per token and layer")
    p.add_argument("--text-field", default="text")
    p.add_argument("--seq-len", type=positive_int, default=128, help="tokens per traced window")
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help="windows per forward (default: those that fill the 512-token prefill --memory reserves, "
                        "with or without --memory, so that the two traces are bit-equal; --memory cuts a larger one)")
    p.add_argument("--hidden-states", action="store_true",
                   help="keep each MoE layer's input hidden state per token too (bfloat16), to train a probe")
    p.add_argument("--decode-tokens", type=positive_int, default=None, metavar="N",
                   help="a decode trace: a prompt from each window (its first --prompt-tokens tokens) followed by "
                        "the model's greedy continuation of N tokens, the routing the runtime serves; train a "
                        "predictor on it (docs/tracing.md#decode-traces) (default: the windows themselves)")
    p.add_argument("--prompt-tokens", type=positive_int, default=16, metavar="N",
                   help="with --decode-tokens: tokens per prompt (default: 16, as bench --memory's prompts)")
    p.add_argument("--out", type=output_dir, required=True, help="trace folder (a new one, or one to resume)")
    # without --memory or --budget the model is loaded whole; with either, through the runtime
    add_runtime_args(p, "memory", "budget", "store", "dtype")
    return p


def run(args: argparse.Namespace) -> None:
    from offload_runtime.engine.loader import load_offloaded
    from training.tracing import trace_model

    options = runtime_options(args)
    model = load_offloaded(args.model, None, options) if args.memory or args.budget else None
    batch_size = windows_per_forward(args.batch_size, args.seq_len, capped=args.memory is not None)
    with model if model is not None else nullcontext():
        out = trace_model(args.model, args.dataset, args.out, split=args.split, max_tokens=args.max_tokens,
                          top_t=args.top_t, text_field=args.text_field, seq_len=args.seq_len,
                          batch_size=batch_size, hidden_states=args.hidden_states, dtype=options.torch_dtype,
                          model=model, decode_tokens=args.decode_tokens, prompt_tokens=args.prompt_tokens)
    print(f"trace written to {out}")


def windows_per_forward(batch_size: int | None, seq_len: int, capped: bool) -> int:
    """The windows per forward: `batch_size`, or by default the tokens of the prefill a `--memory`
    plan reserves activations for, whether capped or not, since the batch is no part of a trace but
    moves the float rounding of some models' router logits (docs/tracing.md); `capped`, at most
    those: a bigger batch's activations are not in the plan (16 windows of 128 tokens were killed
    by the kernel in a cgroup at 0.58 and 0.65 GB on runs/tb: results/trace-capped-tb-batch16.json)."""
    from offload_runtime.engine.memory_plan import PREFILL_TOKENS

    fits = max(1, PREFILL_TOKENS // seq_len)
    if batch_size is None:
        return fits
    if capped and batch_size > fits:
        log.info("--memory: %d windows of %d tokens per forward (not --batch-size %d), the %d-token prefill "
                 "the memory plan reserves activations for", fits, seq_len, batch_size, PREFILL_TOKENS)
        return fits
    return batch_size
