"""What `prescient bench-batch` and `prescient bench-kernels` share beyond the schedules: the
ranking that decides which experts stay resident, and a median with its spread over repeats."""

from __future__ import annotations

from typing import Any


def median_spread(values: list[float]) -> dict[str, Any]:
    """The median, minimum, maximum and count of repeated measurements."""
    import statistics

    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def hot_ranking(fingerprint, trace: str | None) -> list[list[float]]:
    """[L][E] expert frequencies from `trace` (hottest experts stay resident), else by expert id."""
    import numpy as np

    from cache.simulator import expert_frequencies
    from prescient.traces import load_trace

    if trace is None:
        return [[-e for e in range(fingerprint.n_experts)] for _ in range(fingerprint.n_moe_layers)]
    loaded = load_trace(trace)
    fingerprint.require_same(loaded.fingerprint, f"trace {trace}")
    return np.asarray(expert_frequencies(loaded["topk_ids"].numpy(), fingerprint.n_experts)).tolist()
