"""`prescient report`: the docs' generated pages, rendered: the results pages and the README's
headline table from `results/*.json` (`experiments.report`), and the command reference from this
command line's own parser (`cli.reference`)."""

from __future__ import annotations

import argparse
import sys

from cli.commands import add_command


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = add_command(subparsers, "report")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a committed page differs")
    return p


def run(args: argparse.Namespace) -> None:
    from cli.reference import render_commands
    from experiments.report import PAGES_DIR, ROOT, render_all, stale, uncited
    from prescient.atomic import write_atomic

    pages = {**render_all(), **render_commands()}
    differ = stale(pages)
    if args.check:
        for page in differ:
            print(f"error: {page.relative_to(ROOT)} differs from what it renders to; run `prescient report` and "
                  "commit it", file=sys.stderr)
    else:
        PAGES_DIR.mkdir(parents=True, exist_ok=True)
        for page in differ:
            write_atomic(page, lambda tmp, text=pages[page]: tmp.write_text(text))
            print(f"wrote {page.relative_to(ROOT)}")
    missing = uncited()
    if missing:
        print(f"{len(missing)} JSONs in results/ that no page cites (cite or delete them):")
        for name in missing:
            print(f"  results/{name}")
    if args.check and differ:
        raise SystemExit(1)
