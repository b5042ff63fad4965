"""A random-read curve: what the slow tier's link gives at each queue depth, as a hardware
profile keeps it (`HardwareProfile.random_reads`) and as `link_profile.measure_random_reads`
measures it, with the rule that picks the depth the runtime keeps (`chosen_depth`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prescient.errors import PrescientError

WITHIN = 0.05  # the chosen depth: the smallest whose rate is within this share of the best


class LinkProfileError(PrescientError):
    """A queue depth, read size or probe file the random-read measurement cannot use."""


@dataclass(frozen=True)
class ReadCurve:
    """Random cold reads of `expert_bytes` each: bytes/s (all reads in flight together) per queue
    depth, the median of `repeats` (every repeat kept), and the depth the runtime keeps."""

    expert_bytes: int
    depths: tuple[int, ...]
    bytes_per_s: tuple[float, ...]
    repeats: tuple[tuple[float, ...], ...]
    depth: int
    source: str = ""

    def __post_init__(self) -> None:
        if not (len(self.depths) == len(self.bytes_per_s) == len(self.repeats)) or self.depth not in self.depths:
            raise LinkProfileError(f"a random-read curve needs one rate and its repeats per depth and the chosen depth "
                                   f"among them; got depths {self.depths}, depth {self.depth}")

    @property
    def rate(self) -> float:
        """Bytes/s with `depth` reads in flight."""
        return self.rate_at(self.depth)

    def rate_at(self, depth: int) -> float:
        """Bytes/s with `depth` reads in flight: the measured depth at or below it (reads beyond
        the deepest measured gain nothing more)."""
        below = [d for d in self.depths if d <= depth]
        if not below:
            raise LinkProfileError(f"no rate measured at {depth} reads in flight or fewer (depths {self.depths})")
        return self.bytes_per_s[self.depths.index(max(below))]

    def rates_up_to(self, depth: int) -> tuple[float, ...]:
        """Bytes/s with 1, 2, ..., `depth` reads in flight (`rate_at` each)."""
        return tuple(self.rate_at(n) for n in range(1, depth + 1))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReadCurve:
        try:
            return cls(int(data["expert_bytes"]), tuple(data["depths"]), tuple(data["bytes_per_s"]),
                       tuple(tuple(r) for r in data["repeats"]), int(data["depth"]), data.get("source", ""))
        except (KeyError, TypeError, ValueError) as exc:
            raise LinkProfileError(f"a random-read curve needs expert_bytes, depths, bytes_per_s, repeats and depth "
                                   f"({exc!r})") from None


def chosen_depth(depths: Sequence[int], rates: Sequence[float]) -> int:
    """The smallest depth whose rate is within `WITHIN` of the best."""
    best = max(rates)
    return min(d for d, r in zip(depths, rates) if r >= (1 - WITHIN) * best)
