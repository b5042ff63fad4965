"""prescient: learned expert prediction and caching for offloaded MoE inference.

Each command is a module of this package with `add_parser(subparsers)` and `run(args)`;
`prescient train` hands its arguments to LightningCLI, which parses its own YAML.

Exit statuses, set here alone: 0 done; 2 an error the user can act on (`PrescientError`: bad
input, a write that failed; or an OSError that only a lack of room makes, from a writer outside
`prescient.atomic`), as one `error:` line; 128 + the signal's number when SIGINT (130) or SIGTERM
(143) stopped the command, after its cleanup left nothing half-written.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import logging
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from cli.commands import COMMANDS, Parser, add_command
from prescient.atomic import cannot_write
from prescient.errors import PrescientError, StoppedBySignal

log = logging.getLogger("prescient")

NO_ROOM = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}  # a write fails for want of room, not by a bug

def build_parser(command: str | None = None) -> tuple[argparse.ArgumentParser, dict[str, object]]:
    """The parser of every command, and each command's module; with `command`, the module of that
    command alone is imported and the others are listed by their line in `COMMANDS` (what
    `prescient --help` shows), so that a command loads only what it needs."""
    parser = Parser(prog="prescient", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    modules = {}
    for name, (module_name, _line) in COMMANDS.items():
        if command is None or name == command:
            modules[name] = importlib.import_module(f"cli.{module_name}")
            modules[name].add_parser(sub)
        else:
            add_command(sub, name)
    return parser, modules


def run_command(argv: list[str]) -> None:
    """Parse and run one `prescient` command (what `main` does, minus exit-code handling)."""
    if argv and argv[0] == "train":  # LightningCLI parses its own arguments
        from cli.train import run_train

        run_train(argv[1:])
        return
    named = argv[0] if argv and argv[0] in COMMANDS else ""  # "": no command named (`prescient --help`)
    parser, modules = build_parser(named)
    args = parser.parse_args(argv)
    from cli.args import compile_kernels_ahead  # numba, which `prescient --help` does without

    compile_kernels_ahead(args, restartable=argv == sys.argv[1:])  # before the command imports torch
    modules[args.command].run(args)


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """While the command runs, SIGINT and SIGTERM raise `StoppedBySignal` in the main thread (handlers
    such as Lightning's and uvicorn's chain to or replace these for their own span)."""
    def stop(signum: int, _frame: object) -> None:
        raise StoppedBySignal(signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        with stop_on_signals():
            run_command(list(sys.argv[1:] if argv is None else argv))
    except PrescientError as exc:
        log.error("error: %s", " ".join(str(exc).split()))  # one line, whatever the message holds
        raise SystemExit(2) from None
    except OSError as exc:
        if exc.errno not in NO_ROOM:
            raise
        log.error("error: %s", cannot_write(exc.filename or "an output file", exc.strerror))
        raise SystemExit(2) from None
    except StoppedBySignal as exc:
        log.error("error: stopped by %s; nothing is left half-written: run the command again (trace and "
                  "reference-model resume where they stopped)", exc)
        raise SystemExit(128 + exc.signum) from None


if __name__ == "__main__":
    main()
