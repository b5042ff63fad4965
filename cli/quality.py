"""`prescient quality`: perplexity, next-token KL and top-1 agreement of a (compressed) model
against its reference on held-out text."""

from __future__ import annotations

import argparse

from cli.args import add_runtime_args, names, output_file, positive_int, runtime_options
from cli.commands import add_command


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = add_command(subparsers, "quality")
    p.add_argument("--model", required=True, help="model directory measured (e.g. the output of prescient quantize)")
    p.add_argument("--reference", required=True, help="the uncompressed model directory it is compared with")
    p.add_argument("--dataset", type=names, default=("stdlib-code", "stdlib-docs"),
                   help="comma list of dataset specs: stdlib-code, stdlib-docs, json:PATH, ... or hub names")
    p.add_argument("--split", default="validation", choices=("train", "validation", "test"))
    p.add_argument("--text-field", default="text")
    p.add_argument("--seq-len", type=positive_int, default=256)
    p.add_argument("--windows", type=positive_int, default=64, help="held-out windows per dataset")
    # both models compute in --dtype; with --memory or --budget both run through the runtime (experts read from
    # --store), as trace does; packed slots and mixed precision always do
    add_runtime_args(p, "memory", "dtype", "slot_format", "policy", "budget", "store", "fine_model", "fine_share",
                     "precision_rule")
    p.add_argument("--predictor", help="the runtime's predictor artifact (mixed precision's forecast rule needs one)")
    p.add_argument("--decode", action="store_true",
                   help="teacher-forced one token per forward, as a sequence decodes (implied by --fine-model, "
                        "whose choices are made per token)")
    p.add_argument("--json", type=output_file, required=True, help="results file")
    return p


def run(args: argparse.Namespace) -> None:
    from experiments.quality import run_quality

    result = run_quality(args.json, model_dir=args.model, reference_dir=args.reference, datasets=args.dataset,
                         split=args.split, text_field=args.text_field, seq_len=args.seq_len, windows=args.windows,
                         options=runtime_options(args), predictor=args.predictor, decode=args.decode,
                         offload=args.memory is not None or args.budget is not None)
    for name, figures in result["datasets"].items():
        print(f"{name}: perplexity {figures['perplexity']:.3f} (reference {figures['reference_perplexity']:.3f}, "
              f"{100 * figures['perplexity_increase']:+.2f}%), KL {figures['kl_nats']:.5f} nats, "
              f"top-1 agreement {figures['top1_agreement']:.4f}"
              + (f", fine copies {100 * figures['fine_share']:.1f}% of expert uses" if "fine_share" in figures else ""))
