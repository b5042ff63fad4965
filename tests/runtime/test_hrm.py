"""The HRM performance model: hand-computed rooflines, the tier max, op formulas, model specs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from offload_runtime.compression.writer import quantize_model
from offload_runtime.engine.store import ExpertStore
from offload_runtime.planning.hardware import HardwareProfile, Processor
from offload_runtime.planning.hrm import (ModelSpec, ModelSpecError, Op, Policy, BatchPolicyError, Workload, decode_ops, estimate,
                                 expected_experts, head_op, predict, roofline, stage_time)
from prescient.loading import load_without_experts

MIXTRAL = Path(__file__).resolve().parents[2] / "configs" / "models" / "mixtral-8x7b"

# round numbers: every roofline below is exact
CPU = Processor(peak_flops=1e11, memory_bandwidth=1e10, memory_bytes=1e12)
GPU = Processor(peak_flops=1e12, memory_bandwidth=1e11, memory_bytes=1e11)
WITH_GPU = HardwareProfile("test-gpu", cpu=CPU, gpu=GPU, cpu_to_gpu=1e9, disk_to_cpu=1e8)
CPU_ONLY = HardwareProfile("test-cpu", cpu=CPU, disk_to_cpu=1e9)
# h=4, I=8 per expert, 1 layer, 2 heads of 2 (q_dim 4), 1 kv head (kv_dim 2), 4 experts top-2, 1 byte/param
TINY = ModelSpec("tiny", hidden_size=4, intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=2,
                 num_experts=4, top_k=2, vocab_size=10, bytes_per_param=1)


def test_roofline_compute_bound_and_memory_bound():
    assert roofline(flops=2e12, nbytes=1e10, processor=GPU) == pytest.approx(2.0)  # 2 s compute vs 0.1 s memory
    assert roofline(flops=1e9, nbytes=5e11, processor=GPU) == pytest.approx(5.0)   # 1 ms compute vs 5 s memory


def test_layer_time_is_the_max_of_the_tiers_and_each_tier_sums_its_ops():
    head = Op("head", "gpu", 0, 0)
    ops = [Op("a", "gpu", 1e12, 0), Op("b", "gpu", 0, 2e11),  # GPU: 1 s + 2 s
           Op("c", "cpu", 1e11, 0),                           # CPU: 1 s
           Op("d", "link", 0, 2.5e9), Op("e", "link_back", 0, 0.5e9)]  # 2.5 s into the GPU, 0.5 s back
    gpu_bound = stage_time(TINY, WITH_GPU, ops, head)
    assert gpu_bound.tiers == pytest.approx({"cpu": 1.0, "gpu": 3.0, "link": 2.5, "link_back": 0.5})
    assert gpu_bound.layer_seconds == pytest.approx(3.0) and gpu_bound.bottleneck == "gpu"
    link_bound = stage_time(TINY, WITH_GPU, [*ops, Op("f", "link", 0, 2e9)], head)
    assert link_bound.layer_seconds == pytest.approx(4.5) and link_bound.bottleneck == "link"
    cpu_bound = stage_time(TINY, WITH_GPU, [*ops, Op("g", "cpu", 0, 5e10)], head)
    assert cpu_bound.layer_seconds == pytest.approx(6.0) and cpu_bound.bottleneck == "cpu"


def test_decode_ops_by_hand():
    """N=2 requests in micro-batches of 1; context 3 + 2/2 = 4 on average."""
    ops = {op.name: op for op in decode_ops(TINY, CPU_ONLY, Workload(3, 2), Policy(2, 1, "cpu", "cpu", r_w=0.25))}
    # QK^T and PV: 2 matmuls × 2 FLOP × N · q_dim · ctx; reads K and V of 4 tokens, q in, out
    assert (ops["attention"].flops, ops["attention"].nbytes) == (4 * 2 * 4 * 4, 2 * (4 * 2 * 2 + 2 * 4))
    # 3 matrices of 4×8 per routed copy, 2 copies per token; each micro-batch (one token)
    # touches k = 2 experts of 3·4·8 bytes; hidden in and out
    assert (ops["experts"].flops, ops["experts"].nbytes) == (6 * 2 * 2 * 4 * 8, 2 * 2 * 96 + 2 * 2 * 4)
    assert ops["expert_weights"].tier == "link" and ops["expert_weights"].nbytes == 0.75 * 4 * 96
    assert "kv_to_gpu" not in ops and "qkv_to_cpu" not in ops


def test_cpu_only_adds_attention_and_ffn_while_a_gpu_overlaps_them():
    workload, n = Workload(512, 64), 64
    alone = estimate(TINY, CPU_ONLY, workload, Policy(n, 8, "cpu", "cpu", r_w=1.0)).decode
    seconds = {op.name: s for op, s in alone.ops}
    assert all(op.tier == "cpu" for op, _ in alone.ops)
    assert alone.layer_seconds == pytest.approx(sum(seconds.values()))
    assert alone.layer_seconds > seconds["attention"] + seconds["experts"]
    # the same CPU beside a GPU as fast as itself: attention (CPU) and FFN (GPU) overlap
    twin = HardwareProfile("twin", cpu=CPU, gpu=CPU, cpu_to_gpu=1e12)
    split = estimate(TINY, twin, workload, Policy(n, 8, "cpu", "gpu", r_w=1.0)).decode
    assert split.tiers["cpu"] == pytest.approx(seconds["attention"])
    assert split.layer_seconds == pytest.approx(max(split.tiers.values()))
    assert split.layer_seconds < alone.layer_seconds


def test_expected_distinct_experts():
    assert expected_experts(1, 8, 2) == pytest.approx(2)
    assert expected_experts(1, 64, 6) == pytest.approx(6)
    counts = [expected_experts(m, 8, 2) for m in (1, 2, 4, 16, 64)]
    assert counts == sorted(counts) and counts[1] == pytest.approx(8 * (1 - 0.75**2))
    assert expected_experts(1000, 8, 2) == pytest.approx(8)


def test_throughput_counts_prefill_and_gen_len_minus_one_steps():
    workload, policy = Workload(16, 5), Policy(4, 2, "cpu", "gpu", r_w=0.5)
    est = estimate(TINY, WITH_GPU, workload, policy)
    assert est.tokens_per_s == pytest.approx(4 * 5 / (est.prefill.seconds + 4 * est.decode.seconds))
    assert est.decode_tokens_per_s == pytest.approx(4 / est.decode.seconds)
    assert predict(TINY, WITH_GPU, workload, policy) == est.tokens_per_s
    assert est.decode.seconds == pytest.approx(est.decode.layer_seconds + est.decode.head_seconds)
    assert head_op(TINY, policy, "gpu").flops == 2 * 4 * 4 * 10


def test_resident_experts_shorten_a_link_bound_step():
    slow_link = dataclasses.replace(WITH_GPU, cpu_to_gpu=1e3)  # one layer's 384 expert bytes take 0.384 s
    workload = Workload(64, 8)
    steps = [estimate(TINY, slow_link, workload, Policy(8, 4, "cpu", "gpu", r_w=r)).decode for r in (0, 0.5)]
    assert [step.bottleneck for step in steps] == ["link", "link"]
    assert steps[0].tiers["link"] == pytest.approx(0.384 + 8 * 4 / 1e3)  # + attention outputs back to the GPU
    assert steps[1].tiers["link"] == pytest.approx(0.192 + 8 * 4 / 1e3)


def test_policy_errors():
    with pytest.raises(BatchPolicyError, match="multiple of μ"):
        Policy(10, 4)
    with pytest.raises(BatchPolicyError, match="r_c"):
        Policy(4, 2, "cpu", "gpu", r_c=0.5)
    with pytest.raises(BatchPolicyError, match="no GPU"):
        estimate(TINY, CPU_ONLY, Workload(4, 4), Policy(4, 2, "cpu", "gpu"))
    with pytest.raises(BatchPolicyError, match="F_g=0"):
        estimate(TINY, WITH_GPU, Workload(4, 4), Policy(4, 2, "cpu", "cpu", r_w=0.5))


def test_ffn_on_the_cpu_beside_a_gpu_moves_hidden_states_not_experts():
    """F_g = 0: the experts compute where they lie (CPU memory); each token's hidden state goes
    down and its output comes back; the dense weights stay on the GPU."""
    ops = {op.name: op for op in decode_ops(TINY, WITH_GPU, Workload(3, 2), Policy(2, 1, "gpu", "cpu"))}
    assert "expert_weights" not in ops and ops["experts"].tier == "cpu" and ops["qkv_proj"].tier == "gpu"
    assert (ops["ffn_in_to_cpu"].tier, ops["ffn_in_to_cpu"].nbytes) == ("link_back", 2 * 4)
    assert (ops["ffn_out_to_gpu"].tier, ops["ffn_out_to_gpu"].nbytes) == ("link", 2 * 4)
    slow_link = dataclasses.replace(WITH_GPU, cpu_to_gpu=1e3)  # a link so slow that moving experts loses
    streamed, beside = (estimate(TINY, slow_link, Workload(64, 8), Policy(8, 4, "cpu", ffn)).decode
                        for ffn in ("gpu", "cpu"))
    assert beside.layer_seconds < streamed.layer_seconds


def test_turning_points_by_hand():
    """N=8 top-2 on TINY: 6·8·2·4·8 = 3072 FFN FLOPs; all 4 experts (384 B) streamed: I^j = 8;
    μ=8 touches 4·(1 − 0.5^8) experts, 96 B each, + 64 B of hidden: I^i = 3072/(96·3.984375 + 64).
    P1 = min(1e11, 1e10·8)/1e9 = 80 > 8: the CPU beats the link. A 5e10 link: P1 = 1.6,
    P2 = min(1e12, 1e11·I^i)/5e10 = 2·I^i ≈ 13.8 > 8: link-bound. A 1e11 link: P2 = I^i ≈ 6.9 ≤ 8:
    the GPU's memory binds."""
    from offload_runtime.planning.hrm import turning_points

    policy = Policy(8, 8, "cpu", "gpu", r_w=0.0)
    points = turning_points(TINY, WITH_GPU, policy)
    i_gpu = 3072 / (96 * 4 * (1 - 0.5**8) + 64)
    assert points.intensity_cpu == pytest.approx(8) and points.intensity_gpu == pytest.approx(i_gpu)
    assert points.p1 == pytest.approx(80) and points.region == "cpu"
    middle = turning_points(TINY, dataclasses.replace(WITH_GPU, cpu_to_gpu=5e10), policy)
    assert middle.p1 == pytest.approx(1.6) and middle.p2 == pytest.approx(2 * i_gpu) and middle.region == "link"
    fast = turning_points(TINY, dataclasses.replace(WITH_GPU, cpu_to_gpu=1e11), policy)
    assert fast.p2 == pytest.approx(i_gpu) and fast.region == "gpu"
    assert fast.balance == pytest.approx(8 / i_gpu)  # B^{j,i}·I^j / (B^i·I^i), both bandwidths 1e11
    assert turning_points(TINY, CPU_ONLY, Policy(8, 8, "cpu", "cpu")) is None


def test_mixtral_spec_from_config():
    spec = ModelSpec.from_config(MIXTRAL)
    assert spec == ModelSpec("mixtral", 4096, 14336, 32, 32, 8, 128, 8, 2, 32000, bytes_per_param=2)
    assert ModelSpec.from_config(MIXTRAL / "config.json") == spec
    assert spec.expert_total_bytes == 32 * 8 * 3 * 4096 * 14336 * 2
    assert (spec.expert_total_bytes + spec.non_expert_bytes) // 2 == 46_702_792_704  # Mixtral's 46.7B parameters
    assert spec.kv_bytes_per_token == 32 * 2 * 8 * 128 * 2


def test_qwen2_moe_style_spec():
    """Qwen1.5-MoE-A2.7B's shapes: per-expert size under moe_intermediate_size, a shared expert,
    `num_experts`, and transformers 5's `dtype` key."""
    config = {"model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632, "moe_intermediate_size": 1408,
              "shared_expert_intermediate_size": 5632, "num_hidden_layers": 24, "num_attention_heads": 16,
              "num_key_value_heads": 16, "num_experts": 60, "num_experts_per_tok": 4, "vocab_size": 151936,
              "dtype": "bfloat16"}
    spec = ModelSpec.from_dict(config)
    assert (spec.intermediate_size, spec.num_experts, spec.top_k, spec.shared_intermediate_size) == (1408, 60, 4, 5632)
    assert (spec.head_dim, spec.num_kv_heads, spec.bytes_per_param) == (128, 16, 2)
    del config["dtype"]
    assert ModelSpec.from_dict(config).bytes_per_param == 4  # no dtype: float32
    ops = {op.name for op in decode_ops(spec, WITH_GPU, Workload(8, 8), Policy(4, 4, "cpu", "gpu"))}
    assert "shared_expert" in ops


def test_spec_errors(tmp_path):
    with pytest.raises(ModelSpecError, match="num_local_experts / num_experts / n_routed_experts"):
        ModelSpec.from_dict({"hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
                             "num_attention_heads": 2, "num_experts_per_tok": 1, "vocab_size": 4})
    with pytest.raises(ModelSpecError, match="unknown dtype"):
        ModelSpec.from_dict({**json.loads((MIXTRAL / "config.json").read_text()), "torch_dtype": "float13"})
    with pytest.raises(ModelSpecError, match="no model config"):
        ModelSpec.from_config(tmp_path)


@pytest.mark.parametrize("bits, group", [(4, 32), (8, None)])
def test_a_compressed_checkpoints_experts_count_their_stored_bytes(bits, group, tiny_moe_dir, tmp_path):
    """A `prescient quantize` output: the HRM's expert bytes are the codes and scales the store
    reads (within the few bytes of each weight's stored shape)."""
    out = tmp_path / "model"
    quantize_model(tiny_moe_dir("mixtral"), out, bits, group_size=group or "channel")
    spec = ModelSpec.from_config(out)
    model, layers = load_without_experts(out, dtype=torch.float32)
    with ExpertStore(out, model, layers) as store:
        stored = store.stored_nbytes((0, 0))
    assert stored - 3 * 2 * 8 <= spec.expert_bytes <= stored  # weight_shape: two int64 per matrix
    assert spec.expert_bytes < ModelSpec.from_config(tiny_moe_dir("mixtral")).expert_bytes / (7 if bits == 4 else 3)


def test_each_schedule_by_what_distinguishes_it():
    """`estimate_schedule`: link bytes, expert reads and the overlap of each batch schedule, by
    hand on TINY (4 experts of 96 B, top-2) at N=4, μ=2, r_w=0.5 without a GPU."""
    from offload_runtime.planning.hrm import SCHEDULES, estimate_schedule

    workload, policy = Workload(3, 4), Policy(4, 2, "cpu", "cpu", r_w=0.5)
    est = {s: estimate_schedule(TINY, CPU_ONLY, workload, policy, s) for s in SCHEDULES}
    assert est["cgopipe"] == estimate(TINY, CPU_ONLY, workload, policy)

    def op(schedule: str, name: str) -> float:
        return next(o.nbytes for o, _ in est[schedule].decode.ops if o.name == name)

    # CGOPipe and zig-zag: every streamed expert (2 of 4); Klotski: the streamed share of what
    # the group's 4 tokens activate; sequential: that of each micro-batch's 2 tokens, twice
    assert op("cgopipe", "expert_weights") == op("zigzag", "expert_weights") == 2 * 96
    assert op("klotski", "expert_weights") == pytest.approx(0.5 * expected_experts(4, 4, 2) * 96)
    assert op("sequential", "expert_weights") == pytest.approx(2 * 0.5 * expected_experts(2, 4, 2) * 96)
    # Klotski computes each expert once over the group; the others once per micro-batch
    assert op("klotski", "experts") == pytest.approx(expected_experts(4, 4, 2) * 96 + 2 * 4 * 4)
    assert op("cgopipe", "experts") == pytest.approx(2 * expected_experts(2, 4, 2) * 96 + 2 * 4 * 4)
    assert est["klotski-paper"].decode == est["klotski"].decode
    # overlap: without a GPU zig-zag is CGOPipe; sequential and accelerate add every tier
    assert est["zigzag"].decode.seconds == pytest.approx(est["cgopipe"].decode.seconds)
    for schedule in ("sequential", "accelerate"):
        step = est[schedule].decode
        assert step.layer_seconds == pytest.approx(sum(step.tiers.values()))
    assert est["accelerate"].decode.layer_seconds > est["cgopipe"].decode.layer_seconds
    # with a GPU, zig-zag (FlexGen(c), S3) serialises CPU attention and GPU FFN; CGOPipe overlaps them
    gpu_policy = Policy(4, 2, "cpu", "gpu", r_w=0.5)
    flex = estimate_schedule(TINY, WITH_GPU, workload, gpu_policy, "zigzag").decode
    assert flex.layer_seconds == pytest.approx(max(flex.tiers["link"], flex.tiers["link_back"],
                                                   flex.tiers["cpu"] + flex.tiers["gpu"]))
    with pytest.raises(BatchPolicyError, match="unknown schedule"):
        estimate_schedule(TINY, CPU_ONLY, workload, policy, "deepspeed")
