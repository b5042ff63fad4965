"""A MoE-Lightning plan for a model, hardware and workload: the HRM's best policy with its
predicted throughput, per-layer time breakdown, memory use, the FFN's turning and balance points
and the inputs, as one record."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from offload_runtime.planning.hardware import load_profile, parse_size
from offload_runtime.planning.hrm import ModelSpec, Workload, turning_points
from offload_runtime.planning.planner import SearchSpace, search


def make_plan(hardware: str, model_config: str | Path, prompt_len: int, gen_len: int, *,
              cpu_memory: str | None = None, memory_budget: str | None = None,
              space: SearchSpace | None = None) -> dict[str, Any]:
    """Search the policies for `model_config` (a config.json or a model directory) on `hardware`
    (a preset name or a profile JSON). `cpu_memory` ("192GiB") overrides the profile's;
    `memory_budget` caps the expert bytes in the compute device's memory."""
    profile = load_profile(hardware)
    if cpu_memory is not None:
        profile = profile.with_cpu_memory(parse_size(cpu_memory))
    expert_budget_bytes = parse_size(memory_budget) if memory_budget is not None else None
    spec = ModelSpec.from_config(model_config)
    workload = Workload(prompt_len, gen_len)
    space = space or SearchSpace()
    plan = search(spec, profile, workload, expert_budget_bytes=expert_budget_bytes, space=space)
    return {
        "hardware": profile.to_dict(),
        "model": {"config": str(model_config), **spec.to_dict()},
        "workload": {"prompt_len": workload.prompt_len, "gen_len": workload.gen_len},
        "expert_budget_bytes": expert_budget_bytes,
        "search": {**space.to_dict(), "feasible_evaluated": plan.feasible_evaluated},
        "memory": {"use": dataclasses.asdict(plan.usage), "gpu_bytes": profile.gpu and profile.gpu.memory_bytes,
                   "cpu_bytes": profile.cpu.memory_bytes},
        **plan.best.to_dict(),
        "turning_points": points.to_dict() if (points := turning_points(spec, profile, plan.policy)) else None,
    }
