"""Simulator throughput on a synthetic trace: expert accesses per second, per policy.

    prescient bench-simulator results/bench_simulator.json [--tokens 50000 --layers 8 ...]

The trace has skewed expert popularity (Zipf over each layer's experts) and temporal locality
(with probability `repeat` a layer's router logits are averaged with the previous token's), so
hit rates resemble real router traces rather than uniform noise. Timed: `simulate` (a fresh cache
and the compiled replay; best of `--runs`, so numba's one-off compilation is left out) in CPU
seconds of this process (`accesses_per_s`; wall-clock rates, which suffer when the machine is
shared, are `accesses_per_wall_s`); building the Replay from arrays is timed apart.
"""

from __future__ import annotations

import logging
import time

import numba
import numpy as np

from cache.policies import make_policy
from cache.simulator import Replay, simulate

log = logging.getLogger(__name__)


def synthetic_trace(
    n_tokens: int, n_layers: int, n_experts: int, top_k: int, top_t: int, seq_len: int, repeat: float, seed: int
) -> dict[str, np.ndarray]:
    """topk_ids [N, L, k], seq_id [N], topt_ids/topt_logits [N, L, T], predicted_scores [N, L, E]."""
    rng = np.random.default_rng(seed)
    popularity = 1.0 / np.arange(1, n_experts + 1)
    popularity = np.stack([rng.permutation(popularity) for _ in range(n_layers)])
    logits = np.log(popularity)[None] + rng.gumbel(size=(n_tokens, n_layers, n_experts))
    for t in range(1, n_tokens):  # temporal locality: carry part of the previous token's preference
        keep = rng.random((n_layers, 1)) < repeat
        logits[t] = np.where(keep, 0.5 * (logits[t] + logits[t - 1]), logits[t])
    order = np.argsort(-logits, axis=-1)
    topt_ids = order[..., :top_t]
    return {
        "topk_ids": topt_ids[..., :top_k].astype(np.int16),
        "seq_id": np.arange(n_tokens) // seq_len,
        "topt_ids": topt_ids.astype(np.int16),
        "topt_logits": np.take_along_axis(logits, topt_ids, axis=-1).astype(np.float32),
        "predicted_scores": (logits + rng.normal(scale=1.0, size=logits.shape)).astype(np.float32),
    }


def bench_simulator(tokens: int = 50_000, layers: int = 8, experts: int = 64, top_k: int = 2, top_t: int = 8,
                    seq_len: int = 512, repeat: float = 0.5, capacity: int | None = None, layers_ahead: int = 1,
                    transfer_per_step: int = 4, seed: int = 0, runs: int = 3) -> dict:
    """Accesses per second of each policy's replay on a synthetic trace (see the module doc)."""
    settings = dict(locals())
    trace = synthetic_trace(
        tokens, layers, experts, top_k, top_t, seq_len, repeat, seed
    )
    scores = {"topt_ids": trace["topt_ids"], "topt_logits": trace["topt_logits"], "score_top": 2 * top_k}
    started = time.process_time()
    demand = Replay.build(trace["topk_ids"], trace["seq_id"], **scores)
    build_s = time.process_time() - started
    prefetching = Replay.build(
        trace["topk_ids"], trace["seq_id"], predicted_scores=trace["predicted_scores"], **scores
    )
    capacity = capacity or layers * experts // 4
    replays = {
        "lru": (demand, {}),
        "mrs": (demand, {"top_k": top_k}),
        "fifo": (demand, {}),
        "lfu": (demand, {}),
        "belady": (demand, {"future": demand.future()}),
        "lru+prefetch": (prefetching, {}),
        "mrs+prefetch": (prefetching, {"top_k": top_k}),
    }
    policies = {}
    for name, (replay, kwargs) in replays.items():
        wall, cpu = [], []
        for _ in range(runs):
            started = time.process_time()
            result = simulate(
                replay, capacity, make_policy(name.split("+")[0], **kwargs),
                layers_ahead=layers_ahead if replay.predicted else None,
                transfer_per_step=transfer_per_step if replay.predicted else None,
            )
            cpu.append(result.accesses / (time.process_time() - started))
            wall.append(result.accesses / result.seconds)
        policies[name] = {"accesses_per_s": max(cpu), "accesses_per_wall_s": max(wall), **result.to_dict()}
        log.info("%-14s %10.0f accesses/s (CPU time, best of %d)  hit rate %.3f", name, max(cpu), runs, result.hit_rate)
    return {
        "trace": settings | {"accesses": demand.n_accesses, "capacity": capacity},
        "numba": numba.__version__,
        "replay_build_s": build_s,
        "replay_build_accesses_per_s": demand.n_accesses / build_s,
        "policies": policies,
    }
