"""Expert memory budgets and byte sizes: the one place their text is read and checked.

A budget names its unit: "0.5" or "50%" is a fraction of all experts, "12slots" a slot count,
"3GiB" bytes. A bare number above 1 ("48") names no unit and is refused, because it could mean
slots or bytes.
"""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

import psutil

from prescient.errors import CapacityError
from prescient.memory_cap import cgroup_limit

_BYTE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_NUMBER_AND_UNIT = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z%]*)\s*")
MAX_BYTES = 2**60  # 1 EiB: above any machine's memory or disk, and within a 64-bit count
UNITS_HELP = "0.5 or 50% (a fraction of all experts), 12slots (a slot count), or bytes such as 3GiB or 512MB"
MEMORY_HELP = "bytes such as 8GiB, 1.5GB or 700MiB, or a share of this machine's memory such as 25%"

Unit = Literal["fraction", "slots", "bytes"]


def parse_bytes(text: str) -> int:
    """The number of bytes `text` names ("512MiB", "16GB", or a plain count), at most `MAX_BYTES`;
    ValueError naming the text otherwise."""
    match = _NUMBER_AND_UNIT.fullmatch(text)
    unit = match.group(2).lower() if match else "?"
    if not match or (unit and unit not in _BYTE_UNITS):
        raise ValueError(f"cannot read size {text!r}; write e.g. '192GiB', '16GB' or '512MiB'")
    size = Fraction(match.group(1)) * _BYTE_UNITS.get(unit, 1)  # exact: no float to overflow or round
    if size > MAX_BYTES:
        raise ValueError(f"{_too_large('size', text)}; write e.g. '192GiB', '16GB' or '512MiB'")
    return int(size)


def _shown(text: str, most: int = 40) -> str:
    """`text` quoted, its middle cut where it is longer than `most` characters (a size of 400 digits)."""
    text = text.strip()
    return repr(text) if len(text) <= most else f"'{text[:most // 2]}...{text[-most // 2:]}' ({len(text)} characters)"


def _too_large(what: str, text: str) -> str:
    return f"{what} {_shown(text)} is above 1 EiB, more than any machine holds"


def parse_memory(text: str) -> int:
    """The bytes a memory size names: "8GiB", "1.5GB", "700MiB", or "25%" of this machine's
    memory (`machine_memory`); CapacityError naming the value and the forms otherwise."""
    match = _NUMBER_AND_UNIT.fullmatch(text)
    unit = match.group(2).lower() if match else "?"
    if unit == "%":
        share = Fraction(match.group(1)) / 100
        if not 0 < share <= 1:
            raise CapacityError(f"memory share {_shown(text)} is not in (0%, 100%]; write {MEMORY_HELP}")
        return int(share * machine_memory())
    if unit and unit not in _BYTE_UNITS:
        raise CapacityError(f"cannot read a memory size from {_shown(text)}; write {MEMORY_HELP}")
    if not unit:
        raise CapacityError(f"memory size {_shown(text)} names no unit; write {MEMORY_HELP}")
    size = Fraction(match.group(1)) * _BYTE_UNITS[unit]
    if size > MAX_BYTES:
        raise CapacityError(f"{_too_large('memory size', text)}; write {MEMORY_HELP}")
    if size < 1:
        raise CapacityError(f"memory size {_shown(text)} is zero; write {MEMORY_HELP}")
    return int(size)


def machine_memory() -> int:
    """This machine's memory in bytes: its RAM, or the memory limit of the cgroup this process runs
    in where that is lower (a container's share)."""
    limit = cgroup_limit()
    total = psutil.virtual_memory().total
    return min(total, limit) if limit is not None else total


@dataclass(frozen=True)
class Budget:
    """Fast memory for experts, in one of three units; checked when made."""

    amount: float
    unit: Unit

    def __post_init__(self) -> None:
        if not isinstance(self.amount, numbers.Real) or not math.isfinite(self.amount):
            raise CapacityError(f"budget {self.amount!r} is not a finite number; write {UNITS_HELP}")
        if self.unit == "fraction" and not 0.0 < self.amount <= 1.0:
            raise CapacityError(f"budget fraction {self.amount:g} is not in (0, 1]; write {UNITS_HELP}")
        if self.unit in ("slots", "bytes") and (self.amount < 1 or self.amount != int(self.amount)):
            raise CapacityError(f"budget of {self.amount:g} {self.unit} is not a whole number of at least 1")
        if self.unit not in ("fraction", "slots", "bytes"):
            raise CapacityError(f"unknown budget unit {self.unit!r}; write {UNITS_HELP}")

    @classmethod
    def parse(cls, text: str) -> "Budget":
        """`text` with its unit (see the module doc); CapacityError naming the units otherwise."""
        match = _NUMBER_AND_UNIT.fullmatch(text)
        if not match:
            raise CapacityError(f"cannot read a budget from {text!r}; write {UNITS_HELP}")
        exact, unit = Fraction(match.group(1)), match.group(2).lower()
        if exact > MAX_BYTES:
            raise CapacityError(f"budget {_shown(text)} is larger than any machine holds; write {UNITS_HELP}")
        number = float(exact)
        if unit == "%":
            return cls(number / 100, "fraction")
        if unit in ("slot", "slots"):
            return cls(number, "slots")
        if unit in _BYTE_UNITS:
            return cls(parse_bytes(text), "bytes")
        if unit or number > 1:
            raise CapacityError(f"budget {text!r} names no unit; write {UNITS_HELP}")
        return cls(number, "fraction")

    @classmethod
    def of(cls, value: "Budget | float | str") -> "Budget":
        """A budget from the Python API's shorthands: a float is a fraction, a string is parsed."""
        if isinstance(value, Budget):
            return value
        if isinstance(value, str):
            return cls.parse(value)
        if isinstance(value, float):
            return cls(value, "fraction")
        raise CapacityError(f"budget {value!r} is neither a fraction (float), a Budget nor text like {UNITS_HELP}")

    def slots(self, total_experts: int, expert_nbytes: int | None = None) -> int:
        """Slots this budget buys among `total_experts` (uncapped for slots and bytes); bytes need
        `expert_nbytes`."""
        if self.unit == "fraction":
            return round(self.amount * total_experts)
        if self.unit == "slots":
            return int(self.amount)
        if expert_nbytes is None:
            raise CapacityError(f"budget {self} is in bytes, but the expert size is unknown here; "
                                "give a fraction (0.5) or a slot count (12slots)")
        return int(self.amount) // expert_nbytes

    def as_json(self) -> float | str:
        """A fraction as a number, other units as text with their unit."""
        return self.amount if self.unit == "fraction" else str(self)

    def __str__(self) -> str:
        return {"fraction": f"{self.amount:g}", "slots": f"{int(self.amount)}slots",
                "bytes": f"{int(self.amount)}B"}[self.unit]
