"""HybriMoE's intra-layer scheduler: the paper's Fig. 5 situation worked by hand, the fixed rules
as bounds, and a brute force over every assignment on small layers."""

from __future__ import annotations

import itertools
import random

from offload_runtime.engine.hybrid_schedule import DeviceTimes, ExpertTask, makespan, schedule_layer


def best_by_brute_force(tasks: list[ExpertTask], times: DeviceTimes) -> float:
    choices = [("cached", "slow") if t.cached else ("loaded", "slow") for t in tasks]
    return min(makespan(tasks, {t.expert: w for t, w in zip(tasks, where)}, times)
               for where in itertools.product(*choices))


def test_the_slow_device_computes_a_cached_expert_while_the_fast_one_takes_a_loaded_one():
    """Fig. 5's setting: fast compute 1 per expert, slow compute 1 per token, a transfer 2.
    Cached A (4 tokens), B (3), E (1); uncached C (5), D (1). Loading C and computing E and D
    on the slow device ends at 3: fast A 0-1, B 1-2, C (landed at 2) 2-3; slow D 0-1, E 1-2.
    Every miss loaded ends at 5 (D lands at 4); every miss on the slow device at 6 (C alone)."""
    a, b, e, c, d = (ExpertTask(0, 4, True), ExpertTask(1, 3, True), ExpertTask(4, 1, True),
                     ExpertTask(2, 5, False), ExpertTask(3, 1, False))
    tasks, times = [a, b, e, c, d], DeviceTimes(fast_compute_s=1.0, slow_s_per_token=1.0, transfer_s=2.0)
    got = schedule_layer(tasks, times)
    assert got.where == {0: "cached", 1: "cached", 4: "slow", 2: "loaded", 3: "slow"}
    assert got.makespan_s == 3.0 == best_by_brute_force(tasks, times) and got.rule == "hybrimoe"
    assert makespan(tasks, {0: "cached", 1: "cached", 4: "cached", 2: "loaded", 3: "loaded"}, times) == 5.0
    assert makespan(tasks, {0: "cached", 1: "cached", 4: "cached", 2: "slow", 3: "slow"}, times) == 6.0


def test_near_the_brute_force_optimum_and_never_worse_than_a_fixed_rule():
    """Random layers of up to 6 experts where the fast device is the faster one per token (the
    paper's premise): optimal in at least 95% of them, within 1.3x everywhere."""
    rng = random.Random(0)
    optimal, cases = 0, 600
    for _ in range(cases):
        tasks = [ExpertTask(e, rng.randint(1, 16), rng.random() < 0.5) for e in range(rng.randint(1, 6))]
        slow = rng.uniform(0.05, 1.0)
        times = DeviceTimes(slow * rng.uniform(0.05, 1.0), slow, rng.uniform(0.5, 5.0))
        got = schedule_layer(tasks, times)
        best = best_by_brute_force(tasks, times)
        fixed = [makespan(tasks, {t.expert: "cached" if t.cached else miss for t in tasks}, times)
                 for miss in ("loaded", "slow")]
        assert best - 1e-9 <= got.makespan_s <= min(min(fixed), 1.3 * best) + 1e-9
        assert got.makespan_s == makespan(tasks, got.where, times)
        optimal += got.makespan_s <= best + 1e-9
    assert optimal >= 0.95 * cases
