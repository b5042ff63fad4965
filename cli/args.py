"""The argument vocabulary every command shares: budgets with a unit, comma lists, predictor
specs. Each is an argparse `type`, so a bad value is refused in one line before any work."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

from prescient.budget import Budget
from prescient.errors import PrescientError

T = TypeVar("T")


def budget(text: str) -> Budget:
    """`--budget 0.5` / `50%` / `12slots` / `3GiB` (see `prescient.budget`)."""
    try:
        return Budget.parse(text)
    except PrescientError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def list_of(item: Callable[[str], T]) -> Callable[[str], tuple[T, ...]]:
    """An argparse type for a non-empty comma list whose items `item` reads."""
    def parse(text: str) -> tuple[T, ...]:
        items = tuple(item(part.strip()) for part in text.split(",") if part.strip())
        if not items:
            raise argparse.ArgumentTypeError(f"{text!r} lists nothing; give a comma list")
        return items
    parse.__name__ = f"list of {getattr(item, '__name__', 'values')}"
    return parse


budgets = list_of(budget)
positive_ints = list_of(positive_int)
names = list_of(str)


def predictor_specs(text: str) -> dict[str, str | None]:
    """`sida=PATH,corr,token` -> {"sida": "PATH", "corr": None, "token": None}: a built-in name
    (see `predictor.registry`) or NAME=ARTIFACT."""
    specs: dict[str, str | None] = {}
    for item in list_of(str)(text):
        name, _, path = item.partition("=")
        if not name:
            raise argparse.ArgumentTypeError(f"predictor entry {item!r} has no name; write NAME or NAME=ARTIFACT")
        specs[name.strip()] = path.strip() or None
    return specs


def add_results_args(parser: argparse.ArgumentParser, what: str = "results file", plot: str | None = "PNG of the results"
                     ) -> None:
    """`--json OUT` (required) and, unless `plot` is None, `--plot OUT.png`: an experiment's outputs."""
    parser.add_argument("--json", required=True, metavar="OUT", help=what)
    if plot is not None:
        parser.add_argument("--plot", metavar="OUT.png", help=plot)
