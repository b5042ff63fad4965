"""HybriMoE's intra-layer scheduler, as a pure function of one layer's routed experts.

Each routed expert of a layer is computed in one of three ways: on the fast device from its
slot (it is cached), loaded over the link and then computed on the fast device, or computed on
the slow device where it lives without being loaded. HybriMoE (§4.B) decides by simulating the
three timelines: fast compute (a constant time per expert, whatever its tokens), slow compute
(linear in the expert's tokens) and the link (a constant time per expert). Its priority rules:

- the fast device takes cached experts, the highest load first (and loaded ones as they land);
- the slow device takes uncached experts, the lowest load first, and when it has none left,
  cached experts the fast device has not started, the lowest load first;
- the link moves uncached experts, the highest load first; each joins the fast queue on arrival.

At each step of the simulation, the timeline whose next task would end earliest takes it; the
simulation ends when every expert is computed. We keep the paper's rules, and return the best of
its schedule and the two fixed ones (every miss loaded; every miss computed where it lives), so
the choice is never worse than either fixed rule; the paper's Fig. 5 example is in the tests,
with a brute force over every assignment on small layers.

On a GPU host the slow device is the CPU beside the GPU, holding the experts in host memory. On
a CPU-only host both devices are the same cores and "computed where it lives" means read into a
scratch buffer and computed there without taking a slot (admission): the same function then
decides with `fast_compute_s` = the slot's compute time and `slow_s_per_token` the scratch
path's (see the runtime's docs for what is wired).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Literal

Where = Literal["cached", "loaded", "slow"]


@dataclass(frozen=True)
class ExpertTask:
    expert: int
    tokens: int  # the layer's tokens routed to it (its load)
    cached: bool  # resident on the fast device


@dataclass(frozen=True)
class DeviceTimes:
    fast_compute_s: float  # fast device, per expert (constant in its tokens)
    slow_s_per_token: float  # slow device, per token routed to the expert
    transfer_s: float  # the link, per expert


@dataclass(frozen=True)
class LayerSchedule:
    where: dict[int, Where]  # expert -> how it computes
    makespan_s: float  # when the layer's last expert is done
    rule: str  # "hybrimoe", "load-all" or "slow-all": which schedule was the best


def makespan(tasks: list[ExpertTask], where: dict[int, Where], times: DeviceTimes) -> float:
    """The layer's end time when each expert computes as `where` says: the link moves the loaded
    experts highest load first, the fast device computes cached experts first (highest load
    first) and each loaded one as it lands, the slow device its experts one after another."""
    loaded = sorted((t for t in tasks if where[t.expert] == "loaded"), key=lambda t: -t.tokens)
    arrivals = [times.transfer_s * (i + 1) for i in range(len(loaded))]
    fast = 0.0
    for _ in (t for t in tasks if where[t.expert] == "cached"):
        fast += times.fast_compute_s
    for arrival in arrivals:
        fast = max(fast, arrival) + times.fast_compute_s
    slow = sum(times.slow_s_per_token * t.tokens for t in tasks if where[t.expert] == "slow")
    return max(fast, slow)


def hybrimoe_simulation(tasks: list[ExpertTask], times: DeviceTimes) -> dict[int, Where]:
    """HybriMoE's simulated schedule (the module doc's rules)."""
    fast_queue = [(-t.tokens, t.expert, 0.0) for t in tasks if t.cached]  # (-load, expert, ready time)
    heapq.heapify(fast_queue)
    uncached = sorted((t for t in tasks if not t.cached), key=lambda t: (t.tokens, t.expert))
    tokens = {t.expert: t.tokens for t in tasks}
    where: dict[int, Where] = {}
    clock = {"fast": 0.0, "slow": 0.0, "link": 0.0}
    while len(where) < len(tasks):
        moves = []  # (when the timeline's next task would end, tie order, timeline, when it starts)
        if fast_queue:  # waits for the earliest arrival among what is queued
            start = max(clock["fast"], min(item[2] for item in fast_queue))
            moves.append((start + times.fast_compute_s, 0, "fast", start))
        if uncached:
            moves.append((clock["link"] + times.transfer_s, 1, "link", clock["link"]))
        idle_work = [item for item in fast_queue if item[2] == 0.0]
        if uncached or idle_work:
            load = uncached[0].tokens if uncached else tokens[max(idle_work)[1]]
            moves.append((clock["slow"] + times.slow_s_per_token * load, 2, "slow", clock["slow"]))
        _, _, timeline, start = min(moves)
        if timeline == "fast":
            ready_now = [item for item in fast_queue if item[2] <= start]
            item = min(ready_now)  # the highest load among those that have arrived
            fast_queue.remove(item)
            heapq.heapify(fast_queue)
            where.setdefault(item[1], "cached" if item[2] == 0.0 else "loaded")
            clock["fast"] = start + times.fast_compute_s
        elif timeline == "link":
            task = uncached.pop()  # the highest load
            clock["link"] += times.transfer_s
            heapq.heappush(fast_queue, (-task.tokens, task.expert, clock["link"]))
            where[task.expert] = "loaded"
        elif uncached:
            task = uncached.pop(0)  # the lowest load
            clock["slow"] += times.slow_s_per_token * task.tokens
            where[task.expert] = "slow"
        else:  # idle: a cached expert the fast device has not started, the lowest load first
            item = max(item for item in fast_queue if item[2] == 0.0)
            fast_queue.remove(item)
            heapq.heapify(fast_queue)
            clock["slow"] += times.slow_s_per_token * tokens[item[1]]
            where[item[1]] = "slow"
    return where


def schedule_layer(tasks: list[ExpertTask], times: DeviceTimes) -> LayerSchedule:
    """Where each routed expert of a layer computes: HybriMoE's simulated schedule, or a fixed
    rule where that ends sooner (see the module doc)."""
    fixed_miss = {"load-all": "loaded", "slow-all": "slow"}
    candidates = {"hybrimoe": hybrimoe_simulation(tasks, times),
                  **{rule: {t.expert: "cached" if t.cached else miss for t in tasks}
                     for rule, miss in fixed_miss.items()}}
    rule, where = min(candidates.items(), key=lambda item: makespan(tasks, item[1], times))
    return LayerSchedule(where, makespan(tasks, where, times), rule)
