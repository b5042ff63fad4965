"""`prescient archs`: every MoE architecture of the installed transformers, each built tiny and
served through the offloading runtime at 0.5/LRU and 0.25/MRS against the plain model; prints
which are exact and which are refused, with the reason. `--pipeline` also runs, on each exact
one, trace → SiDA training (LightningCLI) → evaluation → serving with the hash function, and
CGOPipe batch decoding (`experiments.arch_pipeline`): a few seconds per family."""

from __future__ import annotations

import argparse

from cli.args import output_file
from cli.commands import add_command


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = add_command(subparsers, "archs")
    p.add_argument("--family", action="append", default=None, metavar="MODEL_TYPE",
                   help="check only this family (config.model_type; repeat for more)")
    p.add_argument("--json", type=output_file, default=None, metavar="OUT", help="also write the rows as JSON here")
    p.add_argument("--markdown", action="store_true", help="print a markdown table (the README's)")
    p.add_argument("--pipeline", action="store_true",
                   help="also trace, train a SiDA hash function, evaluate it and serve with it on each exact family, "
                        "and run CGOPipe batch decoding (or report its refusal)")
    return p


def run(args: argparse.Namespace) -> list[dict]:
    """Check the families, print the table, write `--json`; returns the rows."""
    import logging

    import transformers

    from experiments.arch_support import markdown_table, summary, support_table
    from prescient.atomic import write_json_atomic

    transformers.logging.set_verbosity_error()  # the tiny configs' own warnings are not the user's business
    transformers.logging.disable_progress_bar()
    logging.getLogger("offload_runtime").setLevel(logging.WARNING)
    logging.getLogger("lightning").setLevel(logging.WARNING)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    rows = support_table(args.family)
    if args.pipeline:
        from experiments.arch_pipeline import with_pipeline

        rows = with_pipeline(rows)
    if args.markdown:
        print(markdown_table(rows))
    else:
        width = max(len(r.family) for r in rows)
        print(summary(rows))
        for r in rows:
            extra = f"  | pipeline: {r.pipeline}  | CGOPipe: {r.cgopipe}" if r.pipeline else ""
            print(f"{r.family:<{width}}  {r.status:<9}  {r.detail}{extra}")
    records = [r.to_dict() for r in rows]
    if args.json:
        from experiments.arch_support import SETTINGS

        command = "prescient archs" + (" --pipeline" if args.pipeline else "")
        write_json_atomic(args.json, {"transformers": transformers.__version__, "command": command,
                                      "settings": [f"{budget}/{policy}" for budget, policy in SETTINGS],
                                      "summary": summary(rows), "rows": records})
    return records
