"""The time-true simulator's parameters and what it measures.

`LinkTiming` says how long one MoE layer-step computes (and how much of that its experts take),
how long one expert takes over the link from the slow tier and how many copies the link keeps in
flight; `simulate(..., timing=...)` then plays the replay on a clock (see
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
    expert; `link_bytes_per_s`: the slow tier → slot link's rate (all copies in flight together)
    with `reads_in_flight` copies in flight (the runtime's transfer workers); `depth_rates`: the
    measured rates with 1, 2, ..., `reads_in_flight` copies in flight (a random-read curve, its
    last `link_bytes_per_s`), or () for every depth at `link_bytes_per_s`; `expert_compute_s`:
    seconds of `layer_compute_s` that the layer-step's routed experts compute, together (None:
    all of it)."""

    layer_compute_s: float
    expert_bytes: float
    link_bytes_per_s: float
    reads_in_flight: int = 1
    depth_rates: tuple[float, ...] = ()
    expert_compute_s: float | None = None

    def __post_init__(self) -> None:
        named = [(f.name, getattr(self, f.name)) for f in fields(self) if f.name != "depth_rates"]
        named += [(f"depth_rates[{i}]", r) for i, r in enumerate(self.depth_rates)]
        for name, value in named:
            if value is None and name == "expert_compute_s":
                continue
            if value is None:
                raise TimingError(f"timing parameter {name} is missing; give a positive number")
            if isinstance(value, bool) or not isinstance(value, Real):
                raise TimingError(f"timing parameter {name} must be a number, got {value!r}")
            if not math.isfinite(value) or value <= 0:
                raise TimingError(f"timing parameter {name} must be a finite number > 0, got {value!r}")
        if int(self.reads_in_flight) != self.reads_in_flight:
            raise TimingError(f"reads_in_flight must be a whole number, got {self.reads_in_flight!r}")
        if self.depth_rates and (len(self.depth_rates) != self.reads_in_flight
                                 or self.depth_rates[-1] != self.link_bytes_per_s):
            raise TimingError(f"depth_rates are the rates with 1..reads_in_flight ({self.reads_in_flight}) copies "
                              f"in flight, the last link_bytes_per_s ({self.link_bytes_per_s}); got {self.depth_rates}")
        if self.expert_compute_s is not None and self.expert_compute_s > self.layer_compute_s:
            raise TimingError(f"expert_compute_s ({self.expert_compute_s}) is part of layer_compute_s "
                              f"({self.layer_compute_s}): give at most that")

    @classmethod
    def of_curve(cls, layer_compute_s: float, expert_bytes: float, rates: tuple[float, ...],
                 expert_compute_s: float | None = None) -> LinkTiming:
        """A link that keeps len(`rates`) copies in flight, `rates[n - 1]` bytes/s with n in flight."""
        return cls(layer_compute_s, expert_bytes, rates[-1], len(rates), tuple(rates), expert_compute_s)

    @property
    def transfer_s(self) -> float:
        """Seconds per expert over the link when it keeps `reads_in_flight` copies in flight (with
        one, the seconds one copy takes)."""
        return self.expert_bytes / self.link_bytes_per_s

    @property
    def copy_s(self) -> tuple[float, ...]:
        """Seconds one copy takes when n = 1, 2, ..., `reads_in_flight` run at once: n experts'
        bytes at the rate with n in flight."""
        rates = self.depth_rates or (self.link_bytes_per_s,) * self.reads_in_flight
        return tuple(n * self.expert_bytes / rate for n, rate in enumerate(rates, 1))

    @property
    def expert_s(self) -> float:
        """Seconds the layer-step's routed experts compute, together."""
        return self.layer_compute_s if self.expert_compute_s is None else self.expert_compute_s

    def to_dict(self) -> dict[str, Any]:
        return {"layer_compute_s": self.layer_compute_s, "expert_bytes": self.expert_bytes,
                "link_bytes_per_s": self.link_bytes_per_s, "transfer_s": self.transfer_s,
                "reads_in_flight": self.reads_in_flight, "depth_rates": list(self.depth_rates),
                "expert_compute_s": self.expert_compute_s}


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
