"""A Klotski plan for a model directory: its times measured on this machine, its experts' shares
from a trace (uniform without one), the memory's largest group, and the planner's n and K, as
one record (`prescient plan --schedule klotski`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from offload_runtime.planning.hardware import HardwareProfile, measure_profile
from offload_runtime.planning.hrm import ModelSpec, Workload
from offload_runtime.planning.klotski import max_group_size, plan_group
from offload_runtime.planning.klotski_measure import measure_klotski_times


def memory_bounds(spec: ModelSpec, workload: Workload, micro_batch: int, resident_fraction: float) -> tuple[float, float]:
    """(fixed bytes, bytes per batch) of a Klotski schedule on a CPU-only machine: the dense
    weights and the expert slots (resident r_w of every layer, two layers' streamed experts);
    each batch of `micro_batch` requests its KV cache at the longest context and its activations."""
    resident = round(resident_fraction * spec.num_experts)
    slots = resident * spec.num_layers + 2 * (spec.num_experts - resident)
    fixed = spec.non_expert_bytes + slots * spec.expert_bytes
    batch = micro_batch * workload.max_context * spec.kv_bytes_per_token + spec.activation_bytes(micro_batch)
    return fixed, batch


def klotski_plan(model_dir: str | Path, micro_batch: int, resident_fraction: float, workload: Workload,
                 memory_bytes: float, max_group: int, hardware: HardwareProfile | None = None,
                 trace: str | None = None, hot_count: int | None = None) -> dict[str, Any]:
    """Measure, bound by memory, plan; `max_group` caps n beside the memory (the paper's "manual
    adjustment" when n grows too large)."""
    import torch

    from cache.simulator import expert_frequencies
    from prescient.fingerprint import fingerprint_model
    from prescient.loading import load_model
    from prescient.traces import load_trace

    spec = ModelSpec.from_config(model_dir)
    fixed, per_batch = memory_bounds(spec, workload, micro_batch, resident_fraction)
    bound = min(max_group, max_group_size(memory_bytes, fixed, per_batch, micro_batch))
    profile = hardware or measure_profile(Path(model_dir))
    model, layers = load_model(model_dir, dtype=torch.float32)
    if trace is not None:
        loaded = load_trace(trace)
        fingerprint_model(model, layers).require_same(loaded.fingerprint, f"trace {trace}")
        shares = expert_frequencies(loaded["topk_ids"].numpy(), spec.num_experts).tolist()
    else:
        shares = [[spec.top_k / spec.num_experts] * spec.num_experts for _ in range(spec.num_layers)]
    times = measure_klotski_times(model, layers, micro_batch, round(workload.decode_context), spec.expert_bytes,
                                  profile.link_bandwidth)
    resident = round(resident_fraction * spec.num_experts)
    hottest = [set(sorted(range(spec.num_experts), key=lambda e: -row[e])[:resident]) for row in shares]
    plan = plan_group(times, shares, hottest, micro_batch, bound, spec.top_k, hot_count)
    return {"model": str(model_dir), "hardware": profile.to_dict(), "times": times.to_dict(),
            "shares_from": trace or "uniform", "resident_fraction": resident_fraction,
            "workload": {"prompt_len": workload.prompt_len, "gen_len": workload.gen_len},
            "memory": {"bytes": memory_bytes, "fixed_bytes": fixed, "bytes_per_batch": per_batch,
                       "largest_group": bound},
            **plan.to_dict()}
