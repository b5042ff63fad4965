"""MoE-Lightning's policy search (paper §4.2): the policy with the highest HRM throughput that
fits the memory limits.

Memory, per policy (`Limits.usage`):
- the compute device (the GPU; the CPU on a machine without one) holds the non-expert weights,
  the resident share r_w of the expert weights, a double buffer of 2 × the streamed part of one
  layer's experts, its share of the KV cache (r_c with a GPU; all of it without) and the
  activations of the largest micro-batch (two decode micro-batches in flight, or one prefill);
- CPU memory beside a GPU holds the streamed expert weights and the rest of the KV cache;
- the disk under a CPU-only machine is unbounded;
- an optional expert budget caps resident + double-buffered expert bytes, as the offload
  runtime's `--budget` does;
- with the FFN on the CPU beside a GPU (F_g = 0), every expert stays in CPU memory and none on
  the GPU (r_w = 0).

Every usage is affine in r_w (the resident share grows, the streamed share and its double buffer
shrink) and throughput never falls as r_w grows, so `search` takes, for each (N, μ, placement,
r_c), the highest grid r_w under every limit instead of trying each one.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from offload_runtime.planning.hardware import HardwareProfile
from offload_runtime.planning.hrm import Estimate, ModelSpec, Policy, Workload, estimate
from prescient.errors import CapacityError

log = logging.getLogger(__name__)


class NoFeasiblePolicyError(CapacityError):
    """Not even the smallest policy fits the memory limits."""


@dataclass(frozen=True)
class MemoryUse:
    """Bytes a policy needs: `gpu` (None without a GPU), `cpu`, and `experts` (expert weights
    on the compute device: resident + double buffer)."""

    gpu: float | None
    cpu: float
    experts: float


@dataclass(frozen=True)
class Limits:
    """The memory limits of one (model, hardware, workload), with an optional expert budget."""

    spec: ModelSpec
    hardware: HardwareProfile
    workload: Workload
    expert_budget_bytes: float | None = None

    def usage(self, policy: Policy) -> MemoryUse:
        spec, workload = self.spec, self.workload
        streamed = (1 - policy.r_w) * spec.layer_expert_bytes
        ffn_beside_gpu = self.hardware.gpu is not None and policy.ffn_on == "cpu"  # F_g = 0
        experts = 0.0 if ffn_beside_gpu else policy.r_w * spec.expert_total_bytes + 2 * streamed
        kv = policy.n_requests * workload.max_context * spec.kv_bytes_per_token
        activations = max(2 * spec.activation_bytes(policy.micro_batch),
                          spec.activation_bytes(policy.micro_batch * workload.prompt_len))
        device = spec.non_expert_bytes + experts + activations
        if self.hardware.gpu is None:
            return MemoryUse(gpu=None, cpu=device + kv, experts=experts)
        return MemoryUse(gpu=device + policy.r_c * kv,
                         cpu=(1 - policy.r_w) * spec.expert_total_bytes + (1 - policy.r_c) * kv, experts=experts)

    def _limits(self) -> list[tuple[str, str, float]]:
        """(name, MemoryUse field, capacity) of every limit that applies."""
        hw = self.hardware
        limits = [("CPU memory", "cpu", hw.cpu.memory_bytes)]
        if hw.gpu is not None:
            limits.insert(0, ("GPU memory", "gpu", hw.gpu.memory_bytes))
        if self.expert_budget_bytes is not None:
            limits.append(("expert budget", "experts", self.expert_budget_bytes))
        return limits

    def check(self, policy: Policy) -> str | None:
        """None if `policy` fits, else each limit it breaks with its numbers."""
        use = self.usage(policy)
        broken = [f"{name}: needs {_size(getattr(use, field))}, has {_size(capacity)}"
                  for name, field, capacity in self._limits() if getattr(use, field) > capacity]
        return "; ".join(broken) or None

    def max_r_w(self, policy: Policy, step: float) -> float | None:
        """The highest multiple of `step` in [0, 1] for r_w at which `policy` fits, or None."""
        at0, at1 = self.usage(dataclasses.replace(policy, r_w=0.0)), self.usage(dataclasses.replace(policy, r_w=1.0))
        lo, hi = 0.0, 1.0
        for _, field, capacity in self._limits():
            u0, u1 = getattr(at0, field), getattr(at1, field)
            if u0 == u1:
                if u0 > capacity:
                    return None
            elif u1 > u0:
                hi = min(hi, (capacity - u0) / (u1 - u0))
            else:
                lo = max(lo, (capacity - u0) / (u1 - u0))
        top = math.floor(round(hi / step, 9)) * step
        for r_w in (top, top - step):  # one step down covers floating-point rounding at the edge
            if lo <= r_w <= hi and self.check(dataclasses.replace(policy, r_w=round(r_w, 9))) is None:
                return round(r_w, 9)
        return None


@dataclass(frozen=True)
class SearchSpace:
    """μ: powers of two and multiples of 4 up to `max_micro_batch`; N: every multiple of μ up to
    `max_micro_batches` micro-batches and `max_requests`; r_w and r_c on grids of their steps."""

    max_requests: int = 4096
    max_micro_batch: int = 256
    max_micro_batches: int = 64
    rw_step: float = 0.01
    rc_step: float = 0.1

    def micro_batches(self) -> list[int]:
        powers = {2**i for i in range(self.max_micro_batch.bit_length()) if 2**i <= self.max_micro_batch}
        return sorted(powers | set(range(4, self.max_micro_batch + 1, 4)))

    def request_counts(self, micro_batch: int) -> list[int]:
        top = min(self.max_micro_batches, self.max_requests // micro_batch)
        return [micro_batch * n for n in range(1, top + 1)]

    @staticmethod
    def grid(step: float) -> list[float]:
        return [round(i * step, 9) for i in range(int(round(1 / step)) + 1)]

    def placements(self, hardware: HardwareProfile) -> list[tuple[str, str]]:
        """(attention_on, ffn_on) choices: with a GPU, each of A_g and F_g either way."""
        if hardware.gpu is None:
            return [("cpu", "cpu")]
        return [("cpu", "gpu"), ("gpu", "gpu"), ("cpu", "cpu"), ("gpu", "cpu")]

    @staticmethod
    def weights_grid(hardware: HardwareProfile, ffn_on: str, step: float) -> list[float]:
        """r_w choices: none with the FFN on the CPU beside a GPU (the experts stay there)."""
        return [0.0] if hardware.gpu is not None and ffn_on == "cpu" else SearchSpace.grid(step)

    def policies(self, hardware: HardwareProfile) -> Iterator[Policy]:
        """Every policy of the space, feasible or not (what `search` prunes)."""
        for attention_on, ffn_on in self.placements(hardware):
            for mu in self.micro_batches():
                for n in self.request_counts(mu):
                    for r_c in self.grid(self.rc_step) if attention_on == "gpu" else [0.0]:
                        for r_w in self.weights_grid(hardware, ffn_on, self.rw_step):
                            yield Policy(n, mu, attention_on, ffn_on, r_w, r_c)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Plan:
    best: Estimate
    usage: MemoryUse
    feasible_evaluated: int

    @property
    def policy(self) -> Policy:
        return self.best.policy


@dataclass(frozen=True)
class Evaluation:
    estimate: Estimate
    violation: str | None  # None: the policy fits

    @property
    def policy(self) -> Policy:
        return self.estimate.policy


def evaluate(spec: ModelSpec, hardware: HardwareProfile, workload: Workload, policies: Iterable[Policy],
             expert_budget_bytes: float | None = None) -> list[Evaluation]:
    """The HRM estimate and the memory verdict of each given policy."""
    limits = Limits(spec, hardware, workload, expert_budget_bytes)
    return [Evaluation(estimate(spec, hardware, workload, p), limits.check(p)) for p in policies]


def search(spec: ModelSpec, hardware: HardwareProfile, workload: Workload, *,
           expert_budget_bytes: float | None = None, space: SearchSpace | None = None) -> Plan:
    """The feasible policy of `space` with the highest predicted tokens/s (`Estimate.tokens_per_s`);
    ties go to the first found (smaller μ, then smaller N)."""
    space = space or SearchSpace()
    limits = Limits(spec, hardware, workload, expert_budget_bytes)
    best: Estimate | None = None
    evaluated = 0
    for attention_on, ffn_on in space.placements(hardware):
        for mu in space.micro_batches():
            for n in space.request_counts(mu):
                fits = False
                for r_c in space.grid(space.rc_step) if attention_on == "gpu" else [0.0]:
                    at_zero = Policy(n, mu, attention_on, ffn_on, 0.0, r_c)
                    if space.weights_grid(hardware, ffn_on, space.rw_step) == [0.0]:
                        r_w = None if limits.check(at_zero) else 0.0
                    else:
                        r_w = limits.max_r_w(at_zero, space.rw_step)
                    if r_w is None:
                        continue
                    fits = True
                    candidate = estimate(spec, hardware, workload, Policy(n, mu, attention_on, ffn_on, r_w, r_c))
                    evaluated += 1
                    if best is None or candidate.tokens_per_s > best.tokens_per_s:
                        best = candidate
                if not fits:  # usage grows with N: no larger N fits either
                    break
    if best is None:
        raise NoFeasiblePolicyError(_nothing_fits(limits, space))
    log.info("searched %d feasible policies; best %s at %.2f tokens/s", evaluated, best.policy, best.tokens_per_s)
    return Plan(best, limits.usage(best.policy), evaluated)


def _nothing_fits(limits: Limits, space: SearchSpace) -> str:
    attention_on, ffn_on = space.placements(limits.hardware)[0]
    reasons = {r_w: limits.check(Policy(1, 1, attention_on, ffn_on, r_w, 0.0)) for r_w in (0.0, 1.0)}
    return ("no policy fits in memory; even one request (N=μ=1) breaks it: "
            + " | ".join(f"r_w={r_w:g}: {why}" for r_w, why in reasons.items())
            + ". Give more memory (--cpu-memory, a larger --memory-budget, other hardware) or a shorter workload.")


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"
