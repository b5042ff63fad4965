"""Offloading never changes what the model computes, bit for bit, in float32 and bfloat16: the
prompt's logits (prefill) and every generated step's logits (decode), greedy and seeded sampling,
at slot counts below, at and above the experts one layer routes to, and with every expert
computed as its copy lands (EPS-MoE's order).

In bfloat16 the sum of a token's expert outputs rounds differently when it is formed from
partial sums (experts computed in groups made resident in turn): the runtime must weight and sum
them as the model's own experts code does (`OffloadedExperts._combine`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers as tf

from offload_runtime.engine.loader import load_offloaded
from offload_runtime.engine.options import RuntimeOptions
from prescient.arch_zoo import save_tiny_model
from prescient.loading import load_model, load_tokenizer
from tests.conftest import tiny_test_config
from training.reference_recipe import recipe

PROMPT = "def read_config(path):\n    with open(path) as f:\n        return json.load(f)  # the settings"
NEW_TOKENS = 6
# a layer computed once all its copies are in; each expert as it lands (EPS-MoE); and with the next
# two layers' experts prefetched from each block's input (in-token lookahead)
SCHEDULES = [{"expert_pipeline": False}, {"expert_pipeline": True}, {"expert_pipeline": True, "lookahead_layers": 2}]


def plain_model(path: Path, dtype: str):
    """The resident model, every weight copied into memory of its own: a float32 GEMM's rounding
    can depend on its operands' alignment, and `from_pretrained` may leave a weight at any offset of
    a memory-mapped file, where the runtime's loader copies it."""
    model, layers = load_model(path, dtype=getattr(torch, dtype))
    for param in model.parameters():
        param.data = param.data.clone()
    return model, layers


def decode(model, ids: torch.Tensor, sample: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The generated ids and every step's logits (the first is the prompt's last position)."""
    torch.manual_seed(0)
    settings = {"do_sample": True, "temperature": 0.9, "top_p": 0.95} if sample else {"do_sample": False}
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=model.config.pad_token_id, **settings)
    return out.sequences, torch.stack(out.logits)


def routed_per_layer(model, ids: torch.Tensor) -> int:
    """The most experts one MoE layer of `model` routes the prompt to."""
    counts = []
    hooks = [block.gate.register_forward_hook(lambda _m, _i, out: counts.append(len(torch.unique(out[2]))))
             for block in (layer.mlp for layer in model.model.layers)]
    with torch.inference_mode():
        model(ids)
    for hook in hooks:
        hook.remove()
    return max(counts)


def check_exact(path: Path, dtype: str, slot_counts: list[int], reference=None, experts_implementation=None,
                expert_kernel: str = "model", **options) -> None:
    """Prompt logits, greedy and sampled generations through the runtime equal `reference`'s (the
    plain model of `dtype` unless given) bit for bit at each slot count, grouped and per expert;
    with transformers' own expert kernel unless `expert_kernel` names one of ours that is exact too
    (the default, "gemv", is within 1e-5: `test_streamed_kernel`)."""
    ids = load_tokenizer(path)(PROMPT, return_tensors="pt").input_ids
    if reference is None:
        reference, _ = plain_model(path, dtype)
    with torch.inference_mode():
        want_prefill = reference(ids).logits
    wanted = {sample: decode(reference, ids, sample) for sample in (False, True)}
    for slots in slot_counts:
        for schedule in SCHEDULES:
            model = load_offloaded(path, options=RuntimeOptions(budget=f"{slots}slots", dtype=dtype, **schedule,
                                                                expert_kernel=expert_kernel, **options))
            if experts_implementation is not None:
                model.set_experts_implementation(experts_implementation)
            with model.runtime:
                with torch.inference_mode():
                    assert torch.equal(model(ids).logits, want_prefill), (slots, schedule, "prefill")
                for sample, (tokens, logits) in wanted.items():
                    got_tokens, got_logits = decode(model, ids, sample)
                    assert torch.equal(got_tokens, tokens), (slots, schedule, sample)
                    assert torch.equal(got_logits, logits), (slots, schedule, sample, "decode logits")


@pytest.fixture(scope="module")
def model_dir(tiny_tokenizer, tmp_path_factory):
    """`model_dir(name)`: a tiny Mixtral, Qwen3-MoE or OLMoE, or a random model of the reference
    recipe's architecture ("reference": Mixtral, 4 layers, 16 experts, top-2, hidden 128)."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            if name == "reference":
                config = tf.MixtralConfig(vocab_size=len(tiny_tokenizer), pad_token_id=tiny_tokenizer.pad_token_id,
                                          eos_token_id=tiny_tokenizer.eos_token_id, **recipe("tiny")["model"])
            else:
                config = tiny_test_config(name, tiny_tokenizer)
            built[name] = save_tiny_model(config, tmp_path_factory.mktemp(name), seed=3, tokenizer=tiny_tokenizer)
        return built[name]

    return get


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "olmoe", "reference"])
def test_offloaded_logits_equal_the_resident_model(model_dir, arch, dtype):
    path = model_dir(arch)
    ids = load_tokenizer(path)(PROMPT, return_tensors="pt").input_ids
    model, layers = plain_model(path, dtype)
    routed, top_k, experts = routed_per_layer(model, ids), layers[0].top_k, layers[0].num_experts
    assert top_k < routed  # the prompt needs more slots than the least budget gives
    # below a layer's routed experts (the least budget: one token's top-k), at them, and above
    check_exact(path, dtype, sorted({top_k, routed, min(routed + 2, experts * len(layers))}), reference=model)


@pytest.mark.parametrize("arch, bits", [("mixtral", 4), ("qwen3_moe", 4), ("olmoe", 4), ("mixtral", 8)])
def test_packed_slots_are_exact_at_every_slot_count(int4_model, arch, bits):
    """Packed int4 / int8 slots compute with the eager loop: offloaded equals all resident."""
    path = int4_model(arch, bits)
    resident = load_offloaded(path, options=RuntimeOptions(budget=1.0, dtype="bfloat16", slot_format="packed",
                                                           expert_kernel="model"))
    with resident.runtime:
        check_exact(path, "bfloat16", [2, 3, 5], reference=resident, slot_format="packed")


def test_the_eager_loop_with_top_k_above_two_is_exact(tiny_tokenizer, tmp_path):
    """transformers' eager loop adds a token's outputs in expert-id order, rounding each sum: with
    k = 4 in bfloat16 that order decides the result, and slot order is not expert order. The
    runtime follows an implementation set after loading."""
    config = tiny_test_config("qwen3_moe", tiny_tokenizer)
    config.num_experts_per_tok = 4
    path = save_tiny_model(config, tmp_path / "qwen3-top4", seed=2, tokenizer=tiny_tokenizer)
    model, _ = plain_model(path, "bfloat16")
    model.set_experts_implementation("eager")
    check_exact(path, "bfloat16", [4, 6, 8], reference=model, experts_implementation="eager")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_grouped_mm_on_a_window_of_the_slots_is_exact(model_dir, dtype):
    """transformers' grouped_mm on the CPU costs per group, empty or not, so a layer call computes
    on the slots from its first expert's to its last's (`OffloadedExperts._windowed`); with every
    expert in a slot each sits at its home slot l·E + e, so a window never spans another layer.
    Exact at every budget, and at the full one the windows stay within a layer."""
    path = model_dir("reference")
    ids = load_tokenizer(path)(PROMPT, return_tensors="pt").input_ids
    reference, layers = plain_model(path, dtype)
    want = decode(reference, ids, sample=False)
    total = len(layers) * layers[0].num_experts
    for slots in (total // 4, total):
        model = load_offloaded(path, options=RuntimeOptions(budget=f"{slots}slots", dtype=dtype, expert_kernel="model"))
        with model.runtime as runtime:
            got = decode(model, ids, sample=False)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), slots
            windows = [window for layer in runtime.layers for window in layer.experts._windows]
            assert windows, "the decode steps computed on windows of the slots"
            if slots == total:
                E = layers[0].num_experts
                homes = runtime.pool.map.table.flatten().tolist()
                assert all(slot in (-1, home) for home, slot in enumerate(homes))  # each used expert at home
                assert all(first // E == last // E for first, last in windows)
