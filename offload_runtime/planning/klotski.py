"""Klotski's constraint-sensitive I/O-compute planner (Klotski §7): the smallest group size n
whose multi-batch pipeline has no bubble, from measured times.

A group of n batches of b requests decodes T = n·b tokens per step. Per MoE layer, the copies
must land before the computation that needs them starts (the paper's arrows I-IV):

    (4) n·t_A                                  ≥ t_IO_G
    (5) n·(t_A + t_G)                          ≥ t_IO_G + K·t_IO_E
    (6) n·(t_A + t_G) + t_hot                  ≥ t_IO_G + (K + 1)·t_IO_E
    (7) n·(t_A + t_G) + t_hot + Σ_{i∈Q} t_E,i  ≥ t_IO_G + (K + len(Q))·t_IO_E + t_IO_A

t_A, t_G: one batch's attention and gate; t_IO_*: moving the gate, one expert, the next layer's
attention; t_hot: the hot experts' compute; Q: the activated cold experts. n is the smallest
integer meeting all four in every layer (`plan_group`).

The paper takes len(Q) "from statistical data"; here it comes from each expert's share q_e of a
trace's tokens (a token picks e with probability q_e, Σ_e q_e = k): T tokens activate e with
probability 1 − (1 − q_e)^T and give it T·q_e tokens in expectation, each expert computing in
t_E(m) = fixed + per_token·m. Deviations, each for what this runtime does:
- the hot set the planner expects is the K streamed experts with the largest shares (at run time
  the correlation table picks it per group); resident experts never move and compute with the
  hot ones, so they count in t_hot;
- (6) asks for the first cold expert only as often as one is expected: K + min(1, len(Q));
- the planner can also pick K (`hot_count=None`): the K with the smallest n, ties to the K
  nearest the model's top-k (Klotski's default).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from prescient.errors import CapacityError, PrescientError

INEQUALITIES = ("4", "5", "6", "7")


class KlotskiPlanError(PrescientError):
    """The planner was given inputs it cannot plan with: a bad batch size or K, shares of the wrong size."""


@dataclass(frozen=True)
class KlotskiTimes:
    """Measured seconds (Klotski's planner stage 1)."""

    attention: float  # t_A: one batch's attention half
    gate: float  # t_G: one batch's gate (router)
    expert_fixed: float  # an expert's compute, t_E(m) = expert_fixed + expert_per_token·m
    expert_per_token: float
    io_expert: float  # t_IO_E: one expert over the link
    io_gate: float = 0.0  # t_IO_G (0 here: gates stay resident)
    io_attention: float = 0.0  # t_IO_A (0 here: attention weights stay resident)

    def expert(self, tokens: float) -> float:
        return self.expert_fixed + self.expert_per_token * tokens

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class LayerCheck:
    """One layer's four inequalities at (n, K): each (left side, right side) in seconds."""

    layer: int
    sides: dict[str, tuple[float, float]]
    cold_expected: float  # len(Q)

    @property
    def holds(self) -> bool:
        return all(lhs >= rhs for lhs, rhs in self.sides.values())


@dataclass(frozen=True)
class KlotskiPlan:
    group_size: int  # n
    hot_count: int  # K
    batch_size: int  # b
    bubble_free: bool  # False: no n up to max_group meets every inequality; n = max_group
    max_group: int
    checks: tuple[LayerCheck, ...]  # at the chosen (n, K)

    def to_dict(self) -> dict[str, Any]:
        return {"group_size": self.group_size, "hot_count": self.hot_count, "batch_size": self.batch_size,
                "bubble_free": self.bubble_free, "max_group": self.max_group,
                "layers": [{"layer": c.layer, "cold_expected": c.cold_expected,
                            "sides": {k: list(v) for k, v in c.sides.items()}} for c in self.checks]}


def layer_check(times: KlotskiTimes, shares: Sequence[float], resident: set[int], n: int, batch_size: int,
                hot_count: int, layer: int = 0) -> LayerCheck:
    """Inequalities 4-7 for one layer whose experts take `shares` of the tokens (Σ = top-k)."""
    tokens = n * batch_size
    streamed = sorted((e for e in range(len(shares)) if e not in resident), key=lambda e: -shares[e])
    hot, cold = set(streamed[:hot_count]), streamed[hot_count:]
    chance = [1 - (1 - min(q, 1.0)) ** tokens for q in shares]
    t_hot = sum(chance[e] * times.expert_fixed + times.expert_per_token * tokens * shares[e]
                for e in hot | resident)
    cold_expected = sum(chance[e] for e in cold)
    t_cold = sum(chance[e] * times.expert_fixed + times.expert_per_token * tokens * shares[e] for e in cold)
    attention = n * times.attention
    gated = n * (times.attention + times.gate)
    sides = {
        "4": (attention, times.io_gate),
        "5": (gated, times.io_gate + hot_count * times.io_expert),
        "6": (gated + t_hot, times.io_gate + (hot_count + min(1.0, cold_expected)) * times.io_expert),
        "7": (gated + t_hot + t_cold,
              times.io_gate + (hot_count + cold_expected) * times.io_expert + times.io_attention),
    }
    return LayerCheck(layer, sides, cold_expected)


def checks(times: KlotskiTimes, shares: Sequence[Sequence[float]], resident: Sequence[set[int]], n: int,
           batch_size: int, hot_count: int) -> tuple[LayerCheck, ...]:
    return tuple(layer_check(times, s, r, n, batch_size, hot_count, layer)
                 for layer, (s, r) in enumerate(zip(shares, resident)))


def smallest_group(times: KlotskiTimes, shares: Sequence[Sequence[float]], resident: Sequence[set[int]],
                   batch_size: int, hot_count: int, max_group: int) -> int | None:
    """The smallest n in 1..max_group meeting every inequality in every layer, or None."""
    for n in range(1, max_group + 1):
        if all(c.holds for c in checks(times, shares, resident, n, batch_size, hot_count)):
            return n
    return None


def plan_group(times: KlotskiTimes, shares: Sequence[Sequence[float]], resident: Sequence[set[int]],
               batch_size: int, max_group: int, top_k: int, hot_count: int | None = None) -> KlotskiPlan:
    """Klotski's n (and K when `hot_count` is None) for batches of `batch_size`; `shares[l][e]`:
    expert e's share of layer l's tokens; `resident[l]`: the experts resident for good;
    `max_group`: the largest n the memory holds (`max_group_size`)."""
    if batch_size < 1:
        raise KlotskiPlanError(f"batch size {batch_size}: a batch holds at least one request")
    if max_group < 1:
        raise CapacityError(f"the memory holds no group of batches of {batch_size} (max_group={max_group})")
    if len(shares) != len(resident) or len({len(s) for s in shares}) != 1:
        raise KlotskiPlanError(f"shares for {len(shares)} layers of {sorted({len(s) for s in shares})} experts and "
                               f"resident sets for {len(resident)} layers: give one row per layer, every row as long")
    streamed = min(len(shares[0]) - len(r) for r in resident)
    if hot_count is not None and not 0 <= hot_count <= streamed:
        raise KlotskiPlanError(f"K={hot_count} hot experts: a layer streams {streamed} experts, so K must lie in "
                               f"0..{streamed}")
    candidates = [hot_count] if hot_count is not None else sorted(range(streamed + 1), key=lambda k: abs(k - top_k))
    found = [(n, k) for k in candidates
             if (n := smallest_group(times, shares, resident, batch_size, k, max_group)) is not None]
    if found:
        n, k = min(found, key=lambda nk: nk[0])  # min keeps the first: K nearest top-k among ties
        return KlotskiPlan(n, k, batch_size, True, max_group, checks(times, shares, resident, n, batch_size, k))
    k = candidates[0]
    return KlotskiPlan(max_group, k, batch_size, False, max_group,
                       checks(times, shares, resident, max_group, batch_size, k))


def max_group_size(memory_bytes: float, fixed_bytes: float, batch_bytes: float, batch_size: int) -> int:
    """The largest n whose n batches (KV cache and activations, `batch_bytes` each) fit beside
    `fixed_bytes` (weights, expert slots); a CapacityError when not even one fits."""
    room = math.floor((memory_bytes - fixed_bytes) / batch_bytes)
    if room < 1:
        raise CapacityError(f"the memory ({memory_bytes / 2**30:.2f} GiB) cannot hold one batch of {batch_size} "
                            f"requests: the weights and expert slots take {fixed_bytes / 2**30:.2f} GiB and a batch "
                            f"{batch_bytes / 2**30:.3f} GiB")
    return room
