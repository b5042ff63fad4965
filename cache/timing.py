"""The time-true simulator's parameters and what it measures.

`LinkTiming` says how long one MoE layer-step computes and how long one expert takes over the
link from the slow tier; `simulate(..., timing=...)` then plays the replay on a clock (see
`cache.simulator` for the model) and reports a `TimedStats`. The hide-only rule of cost-aware
prefetch (`copies_in_time`, `hideable`) is here once, for the replay and the runtime. Where the numbers come from (a
`prescient profile-hw` JSON, a runtime bench JSON) is `experiments.timing_calibration`'s business.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from numbers import Real
from typing import Any

import numpy as np

from cache.errors import CacheError
from cache.heap import inline


class TimingError(CacheError, ValueError):
    """A timing parameter is missing, not a number, zero or negative."""


@dataclass(frozen=True)
class LinkTiming:
    """`layer_compute_s`: seconds one MoE layer-step computes with its experts resident (a
    token's compute outside the MoE layers spread over them); `expert_bytes`: bytes of one
    expert; `link_bytes_per_s`: the slow tier → slot link, one transfer at a time."""

    layer_compute_s: float
    expert_bytes: float
    link_bytes_per_s: float

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if value is None:
                raise TimingError(f"timing parameter {field.name} is missing; give a positive number")
            if isinstance(value, bool) or not isinstance(value, Real):
                raise TimingError(f"timing parameter {field.name} must be a number, got {value!r}")
            if not math.isfinite(value) or value <= 0:
                raise TimingError(f"timing parameter {field.name} must be a finite number > 0, got {value!r}")

    @property
    def transfer_s(self) -> float:
        """Seconds one expert takes over the link."""
        return self.expert_bytes / self.link_bytes_per_s

    def to_dict(self) -> dict[str, float]:
        return {"layer_compute_s": self.layer_compute_s, "expert_bytes": self.expert_bytes,
                "link_bytes_per_s": self.link_bytes_per_s, "transfer_s": self.transfer_s}


@inline
def copies_in_time(seconds: float, transfer_s: float, backlog: int) -> int:
    """The hide-only rule's room: how many more copies, behind `backlog` copies waiting or
    running, end within `seconds` on a link that moves one expert in `transfer_s`."""
    return int(seconds / transfer_s) - backlog


@inline
def hideable(resident: np.ndarray, room: int) -> tuple[np.ndarray, int]:
    """The hide-only rule: of wanted keys (their `resident` flags, in prefetch order) the
    positions to prefetch: every resident one (a prefetch call spares its own keys) and the first
    `room` others, whose copies can end before their layer runs; and the room left."""
    kept = np.empty(len(resident), np.int64)
    n = 0
    for i in range(len(resident)):
        if resident[i] or room > 0:
            if not resident[i]:
                room -= 1
            kept[n] = i
            n += 1
    return kept[:n], room


@dataclass(frozen=True)
class TimedStats:
    """A timed replay's clock and link counts. `tokens`: generated tokens (trace rows), over
    which the per-token figures are taken; loads are started transfers (a queued prefetch that
    its layer waited for counts as a demand load, as in the runtime's transfer engine); wasted
    loads: prefetches transferred and evicted before any use."""

    timing: LinkTiming
    tokens: int
    simulated_seconds: float
    stall_seconds: float
    demand_loads: int
    prefetch_loads: int
    wasted_loads: int

    @property
    def bytes_moved(self) -> float:
        return (self.demand_loads + self.prefetch_loads) * self.timing.expert_bytes

    @property
    def bytes_wasted(self) -> float:
        return self.wasted_loads * self.timing.expert_bytes

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.simulated_seconds if self.simulated_seconds else 0.0

    def per_token(self, total: float) -> float:
        return total / self.tokens if self.tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "simulated_seconds": self.simulated_seconds, "stall_seconds": self.stall_seconds,
            "demand_loads": self.demand_loads, "prefetch_loads": self.prefetch_loads,
            "wasted_loads": self.wasted_loads, "bytes_moved": self.bytes_moved, "bytes_wasted": self.bytes_wasted,
            "tokens": self.tokens,
            "seconds_per_token": self.per_token(self.simulated_seconds),
            "stall_seconds_per_token": self.per_token(self.stall_seconds),
            "bytes_moved_per_token": self.per_token(self.bytes_moved),
            "bytes_wasted_per_token": self.per_token(self.bytes_wasted),
            "tokens_per_s": self.tokens_per_s,
        }
