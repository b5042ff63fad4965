"""Policy search under memory limits, hardware presets and profiles, and `prescient plan`."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from offload_runtime.planning.hardware import (PRESETS, HardwareError, HardwareProfile, Processor, load_profile,
                                      measure_profile, parse_size)
from offload_runtime.planning.hrm import ModelSpec, Policy, Workload, predict
from offload_runtime.planning.planner import Limits, NoFeasiblePolicyError, SearchSpace, evaluate, search
from cli import plan as plan_cli

MIXTRAL = Path(__file__).resolve().parents[2] / "configs" / "models" / "mixtral-8x7b"

# 8 experts of 48 KiB in each of 4 layers: 1.5 MiB of experts, 126 KiB of other weights;
# 12 KiB of KV cache per request of 16 + 8 tokens
SPEC = ModelSpec("small", hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                 head_dim=16, num_experts=8, top_k=2, vocab_size=100, bytes_per_param=2)
WORKLOAD = Workload(16, 8)
CPU = Processor(peak_flops=1e11, memory_bandwidth=1e10, memory_bytes=1.5e6)
GPU = Processor(peak_flops=1e12, memory_bandwidth=1e11, memory_bytes=1.5e6)
WITH_GPU = HardwareProfile("small-gpu", cpu=CPU, gpu=GPU, cpu_to_gpu=1e9)
CPU_ONLY = HardwareProfile("small-cpu", cpu=dataclasses.replace(CPU, memory_bytes=1e8), disk_to_cpu=1e8)
SPACE = SearchSpace(max_requests=64, max_micro_batch=8, max_micro_batches=8, rw_step=0.05, rc_step=0.25)


def test_memory_limits_name_the_limit_with_numbers():
    limits = Limits(SPEC, WITH_GPU, WORKLOAD)
    assert limits.check(Policy(1, 1, "cpu", "gpu", r_w=0.1)) is None
    # all experts (1.5 MiB), the other weights (126 KiB) and one prompt's activations (26 KiB)
    assert limits.check(Policy(1, 1, "cpu", "gpu", r_w=1.0)) == "GPU memory: needs 1.65 MiB, has 1.43 MiB"
    too_many = limits.check(Policy(64, 8, "cpu", "gpu", r_w=0.1))  # 64 × 12 KiB of KV on the CPU
    assert too_many.startswith("CPU memory: needs") and "GPU" not in too_many
    use = limits.usage(Policy(64, 8, "cpu", "gpu", r_w=0.1))
    assert use.cpu == pytest.approx(0.9 * SPEC.expert_total_bytes + 64 * 24 * SPEC.kv_bytes_per_token)
    budget = Limits(SPEC, CPU_ONLY, WORKLOAD, expert_budget_bytes=2**20)
    assert budget.check(Policy(1, 1, "cpu", "cpu", r_w=1.0)) == "expert budget: needs 1.50 MiB, has 1.00 MiB"
    assert budget.usage(Policy(1, 1, "cpu", "cpu")).gpu is None


@pytest.mark.parametrize(("hardware", "budget"), [(WITH_GPU, None), (CPU_ONLY, 1.2e6)], ids=["gpu", "cpu-budget"])
def test_search_beats_every_enumerated_feasible_policy(hardware, budget):
    plan = search(SPEC, hardware, WORKLOAD, expert_budget_bytes=budget, space=SPACE)
    every = evaluate(SPEC, hardware, WORKLOAD, SPACE.policies(hardware), expert_budget_bytes=budget)
    feasible = [e for e in every if e.violation is None]
    assert 0 < len(feasible) < len(every)
    assert Limits(SPEC, hardware, WORKLOAD, budget).check(plan.policy) is None
    assert plan.best.tokens_per_s == pytest.approx(max(e.estimate.tokens_per_s for e in feasible))
    assert 0 < plan.policy.r_w < 1  # a limit, not the grid's end, set r_w


def test_search_reports_the_limit_that_stops_the_smallest_policy():
    tiny_gpu = dataclasses.replace(WITH_GPU, gpu=dataclasses.replace(GPU, memory_bytes=5e5))
    with pytest.raises(NoFeasiblePolicyError, match="GPU memory: needs"):
        search(SPEC, tiny_gpu, WORKLOAD, space=SPACE)


def test_presets_profiles_and_sizes(tmp_path):
    t4 = load_profile("t4")
    assert t4.gpu.memory_bytes == 16e9 and t4.cpu_to_gpu < load_profile("t4-pcie4").cpu_to_gpu
    assert {"t4", "l4", "a100", "h100"} <= set(PRESETS)
    with pytest.raises(HardwareError, match="unknown hardware 't5'.*a100, .*h100.*l4.*t4"):
        load_profile("t5")
    path = t4.with_cpu_memory(parse_size("96GiB")).save(tmp_path / "t4.json")
    loaded = load_profile(path)
    assert loaded.cpu.memory_bytes == 96 * 2**30 and loaded == dataclasses.replace(loaded, cpu=loaded.cpu)
    assert load_profile(str(path)).to_dict() == json.loads(path.read_text())
    assert HardwareProfile.from_dict(CPU_ONLY.to_dict()) == CPU_ONLY
    with pytest.raises(HardwareError, match="needs 'name' and 'cpu'"):
        HardwareProfile.from_dict({"name": "x", "cpu": {}, "tpu": 1})
    with pytest.raises(HardwareError, match="does not exist"):
        load_profile(tmp_path / "missing.json")
    assert parse_size("512MiB") == 2**29 and parse_size("16GB") == 16e9
    with pytest.raises(HardwareError, match="cannot read size"):
        parse_size("lots")


def test_measure_profile_of_this_machine(tmp_path):
    profile = measure_profile(tmp_path, disk_bytes=2**20, copy_bytes=2**22, matmul_size=128, repeats=1)
    assert profile.cpu.peak_flops > 1e8 and profile.cpu.memory_bandwidth > 1e8 and profile.disk_to_cpu > 0
    assert profile.cpu.memory_bytes > 2**28 and "page cache dropped" in profile.notes
    assert list(tmp_path.iterdir()) == []  # the probe file is gone
    assert HardwareProfile.from_dict(json.loads(json.dumps(profile.to_dict()))) == profile


def plan(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser()
    plan_cli.add_parser(parser.add_subparsers(dest="command"))
    return plan_cli.run(parser.parse_args(["plan", *argv]))


def test_plan_cli_writes_a_feasible_plan(tmp_path, capsys):
    out = tmp_path / "plan.json"
    returned = plan(["--hardware", "t4", "--model", str(MIXTRAL), "--prompt-len", "242", "--gen-len", "50",
                     "--cpu-memory", "192GiB", "--max-requests", "128", "--max-micro-batch", "32",
                     "--rw-step", "0.05", "--json", str(out)])
    record = json.loads(out.read_text())
    assert record == json.loads(json.dumps(returned))
    policy = Policy(**record["policy"])
    spec, hardware, workload = ModelSpec.from_config(MIXTRAL), load_profile("t4").with_cpu_memory(192 * 2**30), \
        Workload(242, 50)
    assert record["hardware"]["cpu"]["memory_bytes"] == 192 * 2**30 and record["model"]["num_experts"] == 8
    assert Limits(spec, hardware, workload).check(policy) is None
    assert record["tokens_per_s"] == pytest.approx(predict(spec, hardware, workload, policy))
    assert record["decode_step"]["bottleneck"] in ("link", "gpu", "cpu")
    assert {op["name"] for op in record["decode_step"]["ops"]} >= {"attention", "experts", "expert_weights"}
    assert f"{record['tokens_per_s']:.1f} tokens/s" in capsys.readouterr().out


def test_plan_cli_errors():
    with pytest.raises(HardwareError, match="unknown hardware"):
        plan(["--hardware", "t5", "--model", str(MIXTRAL), "--prompt-len", "8", "--gen-len", "8"])
    with pytest.raises(HardwareError, match="cannot read size"):
        plan(["--hardware", "t4", "--model", str(MIXTRAL), "--prompt-len", "8", "--gen-len", "8",
              "--memory-budget", "a lot"])


def test_search_puts_the_ffn_on_the_cpu_when_the_link_is_too_slow():
    """F_g = 0 is searched: behind a link 1000x slower, computing the experts where they lie (CPU
    memory, r_w = 0) beats streaming them; with the usual link the FFN goes to the GPU."""
    roomy = dataclasses.replace(WITH_GPU, cpu=dataclasses.replace(CPU, memory_bytes=1e9))
    assert ("cpu", "cpu") in SPACE.placements(roomy) and SPACE.placements(CPU_ONLY) == [("cpu", "cpu")]
    assert search(SPEC, roomy, WORKLOAD, space=SPACE).policy.ffn_on == "gpu"
    slow = search(SPEC, dataclasses.replace(roomy, cpu_to_gpu=1e6), WORKLOAD, space=SPACE).policy
    assert (slow.ffn_on, slow.r_w) == ("cpu", 0.0)
