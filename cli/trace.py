"""`prescient trace`: router traces of any transformers MoE model over a dataset."""

from __future__ import annotations

import argparse

from cli.args import output_dir, positive_int


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("trace", help="record router traces of an MoE model over a dataset")
    p.add_argument("--model", required=True, help="Hugging Face model directory (or hub name)")
    p.add_argument("--dataset", required=True, help="stdlib-code, stdlib-docs, json:PATH, text:PATH, or a hub name")
    p.add_argument("--split", default="validation", choices=("train", "validation", "test"))
    p.add_argument("--max-tokens", type=positive_int, default=50_000)
    p.add_argument("--top-t", type=positive_int, default=30, help="router logits kept per token and layer")
    p.add_argument("--text-field", default="text")
    p.add_argument("--seq-len", type=positive_int, default=128, help="tokens per traced window")
    p.add_argument("--batch-size", type=positive_int, default=16)
    p.add_argument("--hidden-states", action="store_true",
                   help="keep each MoE layer's input hidden state per token too (bfloat16), to train a probe")
    p.add_argument("--out", type=output_dir, required=True, help="trace folder (a new one, or one to resume)")
    return p


def run(args: argparse.Namespace) -> None:
    from training.tracing import trace_model

    out = trace_model(args.model, args.dataset, args.out, split=args.split, max_tokens=args.max_tokens,
                      top_t=args.top_t, text_field=args.text_field, seq_len=args.seq_len, batch_size=args.batch_size,
                      hidden_states=args.hidden_states)
    print(f"trace written to {out}")
