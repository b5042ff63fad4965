"""`prescient quantize`: a model directory with its routed experts compressed (compressed-tensors
`pack-quantized` int2 / int4 / int8), or stored in bfloat16 (`--bits 16`, the fair uncompressed baseline).
`--method gptq` chooses the integer levels on calibration text (a built-in corpus's train split)."""

from __future__ import annotations

import argparse

from cli.args import output_dir, positive_int
from cli.commands import add_command

CALIBRATION_SEQ_LEN = 256  # tokens per calibration window


def group_size(text: str) -> int | str:
    """A positive group size, or 'channel'."""
    return text if text == "channel" else positive_int(text)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = add_command(subparsers, "quantize")
    p.add_argument("--model", required=True, help="Hugging Face model directory (uncompressed)")
    p.add_argument("--bits", type=int, required=True, choices=(2, 4, 8, 16),
                   help="2, 4 or 8: group-wise symmetric integers (2: packed slots run them in int4 after the "
                        "link; pair it with --method gptq); 16: a bfloat16 copy of the experts")
    p.add_argument("--group-size", type=group_size, default=None,
                   help="weights per scale along a row (default: the largest of 128, 64, 32, 16 that divides "
                        "every expert's input dimension), or 'channel': one scale per row (what --slot-format "
                        "packed runs at 8 bits)")
    p.add_argument("--method", default="rtn", choices=("rtn", "gptq"),
                   help="rtn: round to the nearest level of each group's min/max grid; gptq: the same grid, each "
                        "expert's levels chosen by GPTQ on the inputs calibration text routes to it (runs the whole "
                        "model in float32, layer by layer)")
    p.add_argument("--calibration", default="stdlib-code",
                   help="with --method gptq: the dataset whose train split calibrates (a built-in corpus, "
                        "json:FILE, or a hub dataset)")
    p.add_argument("--calibration-windows", type=positive_int, default=64,
                   help=f"with --method gptq: calibration windows of {CALIBRATION_SEQ_LEN} tokens")
    p.add_argument("--out", type=output_dir, required=True, help="new model directory (must not exist or be empty)")
    return p


def run(args: argparse.Namespace) -> None:
    from offload_runtime.compression.writer import Calibration, quantize_model

    model, calibration = args.model, None
    if args.method == "gptq" and args.bits != 16:  # (16 is refused by quantize_model)
        from prescient.model_dir import ModelDirectory
        from training.reference_lm import corpus_windows

        model = ModelDirectory.open(args.model)  # once: its tokenizer here, its weights in quantize_model
        calibration = Calibration(f"{args.calibration}:train", corpus_windows(
            model.tokenizer(), args.calibration, "train", "text", CALIBRATION_SEQ_LEN, args.calibration_windows))
    report = quantize_model(model, args.out, args.bits, args.group_size, args.method, calibration)
    print(f"{args.out}: experts {report['source_expert_bytes'] / 2**20:.1f} MiB → {report['expert_bytes'] / 2**20:.1f} "
          f"MiB ({report['expert_compression']}x smaller) in {report['seconds']} s, "
          f"peak RSS {report['peak_rss_bytes'] / 2**30:.2f} GiB")
