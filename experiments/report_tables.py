"""What a results page is made of, and the formatting of its numbers: a `Page` of `Table`s, each
read from JSONs in `results/` (`load`), and the README's `Headline`s. The pages themselves are in
`experiments/report_pages/`, one module a page; `experiments/report.py` renders them."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Callable

RESULTS = Path(__file__).resolve().parent.parent / "results"
MACHINE = "the project's 2-core, 24 GiB CPU machine (no GPU)"

Rows = tuple[list[str], list[list[Any]]]


@cache
def load(name: str) -> Any:
    """The JSON `results/<name>` (read once per process)."""
    return json.loads((RESULTS / name).read_text())


@dataclass(frozen=True)
class Table:
    """One table of a results page: `rows()` returns (header, rows) read from `jsons`."""
    title: str
    jsons: tuple[str, ...]
    command: str
    rows: Callable[[], Rows]
    machine: str = MACHINE
    note: str = ""


@dataclass(frozen=True)
class Headline:
    """One row of the README's headline table: `value()` read from `json`, shown on page `slug`."""
    result: str
    value: Callable[[], str]
    slug: str
    json: str


@dataclass(frozen=True)
class Page:
    slug: str
    title: str
    conclusion: str
    tables: tuple[Table, ...] = field(default_factory=tuple)


def num(x: float | None, digits: int = 2) -> str:
    """`x` with `digits` decimals and thin thousands separators; '–' for a missing value."""
    if x is None:
        return "–"
    return f"{x:,.{digits}f}".replace(",", " ")


def pct(x: float | None, digits: int = 2, signed: bool = True) -> str:
    """A fraction as a percentage (0.0035 → '+0.35%')."""
    if x is None:
        return "–"
    return f"{100 * x:{'+' if signed else ''}.{digits}f}%".replace("-", "−")


def spread(median: float, lo_hi: list[float] | None, digits: int = 2) -> str:
    """'median (lo–hi)' of repeated measurements."""
    if not lo_hi:
        return num(median, digits)
    return f"{num(median, digits)} ({num(lo_hi[0], digits)}–{num(lo_hi[1], digits)})"
