"""Computing a layer's routed experts where they live: HybriMoE's scheduler in the runtime.

With `RuntimeOptions.hybrid_schedule`, each fused MoE layer asks `HybridExperts.decide` which of
its routed experts compute without a slot, from the slow tier's own memory, and computes them
there (`lend`) beside the others, summing every output as the model does (`OffloadedExperts`).
Two hosts, one decision point:

- **GPU host, experts in host memory** (`store="host"`): HybriMoE's intra-layer scheduler (§4.B;
  `hybrid_schedule.schedule_layer`) splits each layer's routed experts between the GPU (resident,
  or copied and then computed) and the CPU beside it (computed from the store's host tensors, no
  copy, on a thread of its own while the GPU computes the rest): the link moves the most-loaded
  misses, the CPU takes the least-loaded ones. Its costs are measured once, as HybriMoE's warm-up
  phase does (`measure_times`): the link per expert, the GPU per expert, the CPU per token.
- **CPU-only host**: the two timelines are the same cores, so nothing overlaps and the simulation
  has nothing to balance: computing a miss where it lives costs the read and the compute that a
  slot's load costs. What differs is what it leaves behind, so the decision is admission (a cache
  bypass; the schedule's "computed where it lives" on a host where that is the same device): a
  miss whose predicted reuse is later than every resident expert's (its chance of use by later
  tokens below the lowest chance of any evictable resident expert, `ExpertCache.least_chance`)
  is computed from a scratch buffer (the host store's own tensors, or `top_k` scratch slots the
  disk store reads into: memory beyond the budget) without evicting anything, on the CPU side's
  thread while the inference thread computes the resident experts and waits for the copies. It needs a policy
  with forecasts (learned, learned-belady) and the forward's hash table; without them no miss is
  bypassed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from cache import ExpertCache
from offload_runtime.engine.hybrid_schedule import DeviceTimes, ExpertTask, schedule_layer
from offload_runtime.engine.slots import SlotPool
from offload_runtime.engine.store import ExpertStore


@dataclass
class HybridCounts:
    computed: int = 0  # routed experts computed where they live, not in a slot
    misses: int = 0  # of them, those without a slot (the others were resident: GPU host only)


def split_layer(experts: list[int], loads: list[int], cached: list[bool], times: DeviceTimes) -> list[int]:
    """GPU host: the experts HybriMoE's schedule computes on the CPU (`schedule_layer`'s "slow")."""
    where = schedule_layer([ExpertTask(e, n, c) for e, n, c in zip(experts, loads, cached)], times).where
    return [e for e in experts if where[e] == "slow"]


def admitted(layer: int, experts: list[int], cached: list[bool], cache: ExpertCache,
             later: np.ndarray | None) -> list[int]:
    """CPU-only host: the misses of `experts` not admitted to the cache, those whose chance of use
    by later tokens (`later`, [L, E]; None: no forecast yet) is below the lowest chance of any
    evictable resident expert outside this call."""
    misses = [e for e, c in zip(experts, cached) if not c]
    floor = cache.least_chance([(layer, e) for e in experts]) if misses and later is not None else None
    return [] if floor is None else [e for e in misses if later[layer, e] < floor]


class HybridExperts:
    """Which routed experts compute where they live, and their weights there (module doc).
    `split`: the GPU host's schedule (else the CPU host's admission)."""

    def __init__(self, store: ExpertStore, pool: SlotPool, n_experts: int, top_k: int, split: bool) -> None:
        self.store, self.n_experts, self.split = store, n_experts, split
        self.times: DeviceTimes | None = None  # split: measured by the first layer that decides
        self.counts = HybridCounts()
        host = store.host_layer(0) is not None
        self._scratch = None if host else pool.spec.empty(top_k)  # disk store: read into these, on the CPU
        # the CPU side's thread: beside the GPU (split), or, on a CPU-only host, reading and computing
        # the bypassed misses while the inference thread computes the resident experts and waits for copies
        self._cpu = ThreadPoolExecutor(1, thread_name_prefix="hybrid-cpu")

    def buffers(self, layer: int) -> tuple[dict[str, torch.Tensor], int]:
        """The [n, ...] CPU tensors that `lend`'s tables index for `layer`, and n: the host store's
        layer, or the scratch slots."""
        host = self.store.host_layer(layer)
        if host is not None:
            return host, self.n_experts
        return self._scratch, len(next(iter(self._scratch.values())))

    def decide(self, layer: int, experts: list[int], loads: list[int], cached: list[bool], cache: ExpertCache,
               later: np.ndarray | None) -> list[int]:
        """Of `experts` (their `loads`, and whether each holds a slot), those this call computes
        where they live: the GPU host's schedule, or the CPU host's admission (module doc)."""
        chosen = (split_layer(experts, loads, cached, self.times) if self.split
                  else admitted(layer, experts, cached, cache, later))
        self.counts.computed += len(chosen)
        self.counts.misses += sum(not c for e, c in zip(experts, cached) if e in chosen)
        return chosen

    def lend(self, layer: int, experts: list[int]) -> Iterator[tuple[list[int], torch.Tensor]]:
        """`experts` of `layer` in groups, each with its [E] table of indices into `buffers`
        (-1: not there), while the group's weights are there: the host store's, all at once; or
        read into the scratch slots, as many at a time."""
        buffers, room = self.buffers(layer)
        if self._scratch is None:
            yield experts, torch.arange(self.n_experts)
            return
        for start in range(0, len(experts), room):
            part = experts[start:start + room]
            table = torch.full((self.n_experts,), -1, dtype=torch.long)
            for i, e in enumerate(part):
                self.store.read((layer, e), out={name: buffer[i] for name, buffer in buffers.items()})
                table[e] = i
            yield part, table

    def submit(self, compute: Callable[[], object]) -> Future:
        """Run `compute` on the CPU side's thread, beside what the inference thread does meanwhile."""
        return self._cpu.submit(compute)

    def close(self) -> None:
        self._cpu.shutdown(wait=True)


def _best_of(run: Callable[[], object], sync: Callable[[], None], repeats: int = 3) -> float:
    """The least wall time of `repeats` runs of `run`, each synchronised by `sync`."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def measure_times(fast: nn.Module, slow: nn.Module, expert: dict[str, torch.Tensor], hidden: int,
                  dtype: torch.dtype, device: torch.device, tokens: int = 8) -> DeviceTimes:
    """HybriMoE's warm-up: the fast device's time per expert (one token on `fast`, a twin over the
    slots, at slot 0), the slow device's per token (`tokens` on `slow`, over the host tensors) and
    the link's per expert (one copy of host `expert` to `device`)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def call(module: nn.Module, n: int, on: torch.device) -> Callable[[], object]:
        x = torch.randn(n, hidden, dtype=dtype, device=on)
        ids = torch.zeros(n, 1, dtype=torch.long, device=on)
        weights = torch.ones(n, 1, dtype=dtype, device=on)
        return lambda: module(x, ids, weights)

    landing = {name: torch.empty_like(t, device=device) for name, t in expert.items()}

    def copy() -> None:
        for name, t in expert.items():
            landing[name].copy_(t, non_blocking=True)

    with torch.inference_mode():
        fast_s = _best_of(call(fast, 1, device), sync)
        slow_s = _best_of(call(slow, tokens, torch.device("cpu")), lambda: None) / tokens
        link_s = _best_of(copy, sync)
    return DeviceTimes(fast_compute_s=fast_s, slow_s_per_token=slow_s, transfer_s=link_s)
