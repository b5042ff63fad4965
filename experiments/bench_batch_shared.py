"""What `prescient bench-batch` and `prescient bench-kernels` share beyond the schedules: the
ranking that decides which experts stay resident, a median with its spread over repeats, and the
settings their command lines offer (read here, without torch, by `--help`)."""

from __future__ import annotations

from typing import Any

ACCELERATE_RUNS = ("repeats", "once", "none")  # bench-batch: where the accelerate baseline runs
DEFAULT_GRID = ("8:4:0.5,16:4:0.5,32:4:0.5,32:8:0.5,16:8:0.25,32:8:0.25,32:4:0.25,16:4:0.75,32:16:0.75,8:2:0.75,"
                "64:16:0.5")  # bench-batch's policies N:μ:r_w
# bench-kernels' arms, each run at its policies N:μ:r_w
ARMS = {"model": "the model's own experts implementation, each expert as its copy lands",
        "auto": "per layer call the kernel of the crossover for its tokens per expert; below the pipeline load, "
                "one call once every copy has landed",
        "auto-pipelined": "auto's kernels, each expert as its copy lands at every load (what skipping the "
                          "pipeline changes)"}
DEFAULT_POLICIES = "8:4:0.5,16:4:0.5,64:16:0.5"


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
