"""`prescient archs`: every MoE architecture of the installed transformers, each built tiny and
served through the offloading runtime at 0.5/LRU and 0.25/MRS against the plain model; prints
which are exact and which are refused, with the reason."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("archs", help="list the MoE architectures of this transformers and whether each is "
                                            "served exactly or refused (builds and runs each tiny)")
    p.add_argument("--family", action="append", default=None, metavar="MODEL_TYPE",
                   help="check only this family (config.model_type; repeat for more)")
    p.add_argument("--json", default=None, metavar="OUT", help="also write the rows as JSON here")
    p.add_argument("--markdown", action="store_true", help="print a markdown table (the README's)")
    return p


def run(args: argparse.Namespace) -> list[dict]:
    """Check the families, print the table, write `--json`; returns the rows."""
    import logging

    import transformers

    from offload_runtime.arch_support import markdown_table, support_table
    from prescient.atomic import write_json_atomic

    transformers.logging.set_verbosity_error()  # the tiny configs' own warnings are not the user's business
    transformers.logging.disable_progress_bar()
    logging.getLogger("offload_runtime").setLevel(logging.WARNING)
    rows = support_table(args.family)
    if args.markdown:
        print(markdown_table(rows))
    else:
        width = max(len(r.family) for r in rows)
        for r in rows:
            print(f"{r.family:<{width}}  {r.status:<9}  {r.detail}")
    records = [r.to_dict() for r in rows]
    if args.json:
        write_json_atomic(args.json, {"transformers": transformers.__version__, "rows": records})
    return records
