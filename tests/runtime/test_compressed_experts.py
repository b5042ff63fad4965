"""Compressed experts: `prescient quantize` writes compressed-tensors `pack-quantized` experts that
plain transformers reads, the runtime reads them (and checkpoints compressed-tensors wrote itself),
offloading stays exact within a precision, and a miss moves the compressed bytes."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import transformers as tf
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors import safe_open
from safetensors.torch import save_file

from experiments.quality import measure_quality
from offload_runtime.compression.codec import expand_into, expand_weight, quantize_weight
from offload_runtime.compression.scheme import weight_args
from offload_runtime.compression.writer import quantize_model
from offload_runtime.engine.loader import load_offloaded
from prescient.checkpoint_schemes import CompressionError
from prescient.fingerprint import fingerprint_model_dir
from prescient.loading import load_model, load_tokenizer
from prescient.traces import load_trace
from training.tracing import trace_model

ARCHS = ("mixtral", "qwen3_moe", "olmoe")
PROMPT = "def f(x):\n    return x"


@pytest.fixture(scope="module")
def quantized(tiny_moe_dir, tmp_path_factory):
    """`quantized(arch, bits)`: the tiny model of `arch` written by `quantize_model` (built once)."""
    built: dict[tuple[str, int], Path] = {}

    def get(arch: str, bits: int) -> Path:
        if (arch, bits) not in built:
            out = tmp_path_factory.mktemp(f"{arch}-w{bits}") / "model"
            quantize_model(tiny_moe_dir(arch), out, bits)
            built[arch, bits] = out
        return built[arch, bits]

    return get


def greedy(model, path: Path, tokens: int = 8) -> torch.Tensor:
    ids = load_tokenizer(path)(PROMPT, return_tensors="pt").input_ids
    with torch.inference_mode():
        return model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                              pad_token_id=model.config.pad_token_id)


def logits(model, path: Path) -> torch.Tensor:
    ids = load_tokenizer(path)(PROMPT, return_tensors="pt").input_ids
    with torch.inference_mode():
        return model(ids).logits


@pytest.mark.parametrize("arch, bits", [(arch, bits) for arch in ARCHS for bits in (4, 8, 16)]
                         + [("deepseek_v3", 4), ("phimoe", 4)])
def test_offloaded_compressed_model_equals_it_resident(arch, bits, quantized):
    """Exact within a precision: the same greedy tokens (and logits up to float32 summation order)
    as the same compressed model loaded whole, at a budget that forces misses; each load moves the expert's stored bytes."""
    path = quantized(arch, bits)
    resident, _ = load_model(path, dtype=torch.float32)
    model = load_offloaded(path, policy="lru", budget="25%")
    with model.runtime as runtime:
        assert torch.equal(greedy(model, path), greedy(resident, path))
        # a prefill that selects more experts than slots sums expert groups in another order
        assert torch.allclose(logits(model, path), logits(resident, path), rtol=0, atol=1e-5)
        stats, store = runtime.stats(), runtime.store
        assert stats.loads > 0 and stats.bytes_moved == stats.loads * store.stored_nbytes((0, 0))
        expected = {4: 0.2, 8: 0.35, 16: 0.55}[bits]  # stored / float32 slot bytes, scales included
        assert store.stored_nbytes((0, 0)) < expected * store.expert_nbytes
        assert store.compressed == (bits != 16)


@pytest.mark.parametrize("arch", ARCHS)
def test_plain_transformers_reads_what_quantize_writes(arch, quantized, tiny_moe_dir):
    """transformers with compressed-tensors installed loads the output as it is; its logits lie
    within bf16 rounding of the runtime's on the same compressed weights, and the source's
    fingerprint (what predictors are checked against) is kept."""
    path = quantized(arch, 4)
    plain = tf.AutoModelForCausalLM.from_pretrained(path).eval()
    model = load_offloaded(path, policy="lru", budget="50%")
    with model.runtime:
        ours = logits(model, path)
    theirs = logits(plain, path).float()
    assert (theirs - ours).abs().max() <= 2e-2 * ours.abs().max()
    assert fingerprint_model_dir(path) == fingerprint_model_dir(tiny_moe_dir(arch))
    report = json.loads((path / "quantize.json").read_text())
    assert report["fingerprint"] == fingerprint_model_dir(tiny_moe_dir(arch)).to_dict()
    assert report["bits"] == 4 and report["expert_bytes"] < report["source_expert_bytes"] / 5


def write_with_compressed_tensors(source: Path, out: Path, symmetric: bool) -> Path:
    """A checkpoint as llm-compressor leaves one: every Linear but the LM head, attention and the
    routers compressed, int4 in groups of 16 with float32 scales (and zero points when
    asymmetric), through compressed-tensors' own compressor and config."""
    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=16)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    shutil.copytree(source, out)
    tensors = {}
    with safe_open(str(source / "model.safetensors"), framework="pt") as handle:
        for key in handle.keys():
            tensor = handle.get_tensor(key)
            if ".experts." not in key or not key.endswith(".weight"):
                tensors[key] = tensor
                continue
            groups = tensor.reshape(tensor.shape[0], -1, 16)
            scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
            state = PackedQuantizationCompressor.compress({"weight": tensor, "weight_scale": scale,
                                                           "weight_zero_point": zero}, scheme)
            tensors.update({key[: -len("weight")] + name: t.contiguous() for name, t in state.items()})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    quant = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized",
                               quantization_status="compressed",
                               ignore=["lm_head", "re:.*gate$", "re:.*self_attn.*", "re:.*shared.*"])
    config["quantization_config"] = {"quant_method": "compressed-tensors",
                                     **quant.model_dump(exclude=["quant_method"])}
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_runtime_reads_a_checkpoint_compressed_tensors_wrote(arch, tiny_moe_dir, tmp_path):
    path = write_with_compressed_tensors(tiny_moe_dir(arch), tmp_path / "model", symmetric=True)
    resident, _ = load_model(path, dtype=torch.float32)  # transformers' own reading of it
    model = load_offloaded(path, policy="lru", budget="25%")
    with model.runtime as runtime:
        assert torch.equal(greedy(model, path), greedy(resident, path))
        assert runtime.store.compressed and runtime.stats().loads > 0
    source, _ = load_model(tiny_moe_dir(arch), dtype=torch.float32)
    assert not torch.equal(logits(resident, path), logits(source, path))  # the experts really are int4


def test_runtime_reads_asymmetric_experts_with_zero_points(tiny_moe_dir, tmp_path):
    """transformers 5 cannot expand fused MoE experts with zero points (its loader drops them:
    "Asymmetric quant requires zero-point values"); the runtime can. Offloaded at 25% it
    generates as it does with every expert resident (100%), and unlike the symmetric copy."""
    path = write_with_compressed_tensors(tiny_moe_dir("mixtral"), tmp_path / "asym", symmetric=False)
    symmetric = write_with_compressed_tensors(tiny_moe_dir("mixtral"), tmp_path / "sym", symmetric=True)
    runs = {}
    for name, where, budget in (("small", path, "25%"), ("whole", path, "100%"), ("symmetric", symmetric, "100%")):
        model = load_offloaded(where, policy="lru", budget=budget)
        with model.runtime:
            runs[name] = (greedy(model, where), logits(model, where))
    assert torch.equal(runs["small"][0], runs["whole"][0])
    assert not torch.equal(runs["whole"][1], runs["symmetric"][1])


@pytest.mark.parametrize("bits, group, symmetric", [(4, 16, True), (8, 32, True), (4, None, True), (4, 16, False),
                                                    (8, 16, False), (2, 16, True), (2, None, True)])
def test_fast_expansion_equals_the_librarys(bits, group, symmetric):
    torch.manual_seed(0)
    args = weight_args(bits, group, symmetric)
    weight = torch.randn(48, 64) * 0.05
    parts = quantize_weight(weight, args)
    expected = expand_weight(parts, args)
    out = torch.empty(48, 64)
    assert torch.equal(expand_into(parts, args, out), expected.float())
    error = (expected.float() - weight).norm() / weight.norm()
    assert error < {2: 0.6, 4: 0.15, 8: 0.01}[bits]  # rounding to 4, 16 or 256 levels per group


def test_quantize_refuses_bad_requests_before_writing(tiny_moe_dir, quantized, tmp_path):
    source = tiny_moe_dir("mixtral")
    with pytest.raises(CompressionError, match="--bits 3 is not supported"):
        quantize_model(source, tmp_path / "a", 3)
    with pytest.raises(CompressionError, match=r"--group-size 24 does not divide the experts' input dimensions \[32\]"):
        quantize_model(source, tmp_path / "b", 4, group_size=24)
    with pytest.raises(CompressionError, match="is already compressed"):
        quantize_model(quantized("mixtral", 4), tmp_path / "c", 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_group_sizes_follow_the_widest_that_divides(quantized):
    config = json.loads((quantized("qwen3_moe", 8) / "config.json").read_text())["quantization_config"]
    weights = config["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["group_size"], weights["strategy"]) == (8, 16, "group")  # inputs 32 and 16


def test_trace_of_a_compressed_model_carries_the_sources_fingerprint(quantized, tiny_moe_dir, text_corpus, tmp_path):
    """So traces, and predictors trained on them, of the source serve the compressed model and back."""
    out = trace_model(quantized("mixtral", 8), f"json:{text_corpus}", tmp_path / "trace", split="train",
                      max_tokens=40, top_t=4, seq_len=16, batch_size=4)
    assert load_trace(out).manifest.fingerprint == fingerprint_model_dir(tiny_moe_dir("mixtral"))


@pytest.mark.parametrize("bits", (None, 16, 4))
def test_bfloat16_runtime_equals_the_model_in_bfloat16(bits, quantized, tiny_moe_dir):
    """`dtype="bfloat16"`: slots hold bf16 experts (half a float32 slot's bytes), the model computes
    in bf16, and generation equals the same model loaded whole in bf16."""
    path = tiny_moe_dir("mixtral") if bits is None else quantized("mixtral", bits)
    resident, _ = load_model(path, dtype=torch.bfloat16)
    model = load_offloaded(path, policy="lru", budget="50%", dtype="bfloat16")
    with model.runtime as runtime:
        assert torch.equal(greedy(model, path), greedy(resident, path))
        assert all(buffer.dtype == torch.bfloat16 for buffer in runtime.pool.buffers.values())
        assert runtime.store.expert_nbytes == 2 * sum(math.prod(s) for s in runtime.store.spec.shapes.values())
        assert runtime.stats().loads > 0
        # predictors and traces are built on the float32 reading; a bf16 runtime is still that model
        assert runtime.fingerprint == fingerprint_model_dir(path)


def test_quality_of_a_model_against_itself_and_against_its_int4_copy(quantized, tiny_moe_dir, text_corpus):
    source = tiny_moe_dir("mixtral")
    same = measure_quality(source, source, (f"json:{text_corpus}",), split="train", seq_len=32, windows=4)
    figures = same["datasets"][f"json:{text_corpus}"]
    assert figures["kl_nats"] == 0 and figures["top1_agreement"] == 1 and figures["perplexity_increase"] == 0
    int4 = measure_quality(quantized("mixtral", 4), source, (f"json:{text_corpus}",), split="train", seq_len=32,
                           windows=4)
    figures = int4["datasets"][f"json:{text_corpus}"]
    assert int4["fingerprint_match"] and figures["tokens"] == 4 * 31
    assert figures["kl_nats"] > 0 and figures["top1_agreement"] < 1
    assert figures["perplexity"] != figures["reference_perplexity"]
