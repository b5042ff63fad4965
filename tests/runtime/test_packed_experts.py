"""Packed slots: int4 (int8) experts stay int4 (int8) in the fast tier and compute with torch's
weight-only CPU kernels; int2 experts cross the link at 2 bits and run as int4.

Exact within the placement (offloaded at a budget that forces misses = the same placement with
every expert resident), within bf16 rounding of the same int4 weights expanded, a slot holds the
packed bytes (so a byte budget buys ~3.5x (2x) the bf16 slots), and what no kernel runs is refused
in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from experiments.bench_compressed import bench_compressed
from experiments.bench_runtime.grid import BenchError
from offload_runtime.compression.codec import quantize_weight, unpack_codes
from offload_runtime.compression.kernels import (INT2_TO_INT4, PackedWeights, _arrange, _block_rows, kernel_matrix,
                                                 pack_for_kernel)
from offload_runtime.compression.scheme import weight_args
from offload_runtime.compression.writer import quantize_model
from offload_runtime.engine.loader import load_offloaded
from offload_runtime.engine.options import OptionsError, RuntimeOptions
from prescient.checkpoint_schemes import CompressionError
from prescient.loading import load_tokenizer
from tests.conftest import random_sida
from tests.runtime.conftest import WIDER

PROMPT = "def f(x):\n    return x"
def run(path: Path, tokens: int = 8, **options) -> tuple[torch.Tensor, torch.Tensor, object]:
    """Greedy tokens and the prompt's logits through the runtime, and its stats."""
    model = load_offloaded(path, options=RuntimeOptions(dtype="bfloat16", **options))
    ids = load_tokenizer(path)(PROMPT, return_tensors="pt").input_ids
    with model.runtime as runtime, torch.inference_mode():
        out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                             pad_token_id=model.config.pad_token_id)
        logits = model(ids).logits.float()
        return out, logits, runtime


@pytest.mark.parametrize("arch, bits", [(arch, 4) for arch in WIDER] + [("mixtral", 8), ("qwen3_moe", 8), ("mixtral", 2)])
def test_packed_offloading_is_exact_and_close_to_the_expanded_weights(arch, bits, int4_model):
    path = int4_model(arch, bits)
    resident, resident_logits, _ = run(path, budget=1.0, slot_format="packed")
    offloaded, _, runtime = run(path, budget="25%", slot_format="packed")
    assert torch.equal(offloaded, resident)
    stats = runtime.stats()
    assert stats.loads > 0 and stats.bytes_moved == stats.loads * runtime.store.stored_nbytes((0, 0))
    assert {b.dtype for b in runtime.pool.buffers.values()} == {torch.int8 if bits == 8 else torch.uint8, torch.bfloat16}
    # the same int4 weights expanded to bf16 and multiplied by transformers' own kernels
    _, expanded_logits, expanded = run(path, budget=1.0, slot_format="expanded")
    assert (expanded_logits - resident_logits).abs().max() <= 2e-2 * expanded_logits.abs().max()
    # a slot holds the codes and scales: under a third (int8: about half) of the expanded bf16 slot
    assert runtime.store.expert_nbytes < expanded.store.expert_nbytes / {2: 3, 4: 3, 8: 1.8}[bits]
    if bits == 2:  # what crosses the link is the 2-bit codes: under 0.6 of the int4 slot it fills
        assert runtime.store.stored_nbytes((0, 0)) < 0.6 * runtime.store.expert_nbytes


def test_a_byte_budget_buys_slots_of_packed_bytes(int4_model):
    path = int4_model("mixtral")
    _, _, expanded = run(path, tokens=1, budget=1.0, slot_format="expanded")
    budget = 4 * expanded.store.expert_nbytes  # four bf16 experts' bytes, of 16 experts
    _, _, packed = run(path, tokens=1, budget=f"{budget}B", slot_format="packed")
    assert packed.pool.num_slots == budget // packed.store.expert_nbytes >= 3 * 4
    assert packed.pool.nbytes <= budget


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("rows, cols", [(128, 64), (64, 96), (192, 32)])
def test_our_arrangement_of_codes_is_torchs_packed_layout(rows, cols, bits):
    block = _block_rows()
    if block is None:
        pytest.skip("this CPU's int4 layout is not the one we arrange; torch's converter is used instead")
    generator = torch.Generator().manual_seed(rows)
    stored = torch.randint(0, 256, (rows, cols * bits // 8), dtype=torch.uint8, generator=generator)
    levels = unpack_codes(stored, bits, rows, cols).to(torch.int32) + (INT2_TO_INT4 if bits == 2 else 0)
    assert torch.equal(_arrange(stored, block, bits), torch._convert_weight_to_int4pack_for_cpu(levels, 1))


@pytest.mark.parametrize("bits, rows", [(4, 64), (4, 48), (8, 48), (2, 64), (2, 48)])  # int4/int2: whole blocks, and not (torch's converter)
def test_kernel_on_packed_codes_equals_a_linear_on_the_expanded_weight(bits, rows):
    torch.manual_seed(0)
    group = None if bits == 8 else 32
    weight, args = torch.randn(rows, 128) * 0.05, weight_args(bits, group)
    parts = quantize_weight(weight, args)
    codes = unpack_codes(parts["weight_packed"], bits, rows, 128)
    spec = kernel_matrix(bits, True, args.strategy, group, (rows, 128), "a test weight")
    slot = {suffix: torch.empty(1, *shape, dtype=dtype) for suffix, (shape, dtype) in spec.slot_tensors().items()}
    codes_slot, scales_slot = slot.values()
    pack_for_kernel(spec, parts["weight_packed"].view(torch.uint8), parts["weight_scale"], codes_slot[0], scales_slot[0])
    levels = codes.float() - 2 ** (bits - 1)
    expanded = levels.view(rows, -1, group or 128) * parts["weight_scale"].float().unsqueeze(-1)
    x = torch.randn(3, 128).to(torch.bfloat16)
    out = torch.nn.functional.linear(x, PackedWeights([(codes_slot, scales_slot, spec)])[0])
    expected = x.float() @ expanded.view(rows, 128).t()
    assert out.dtype == torch.bfloat16 and out.shape == (3, rows)
    assert (out.float() - expected).abs().max() <= 1e-2 * expected.abs().max()


def test_what_packed_slots_cannot_run_is_refused_in_one_line(int4_model, tiny_moe_dir, tmp_path):
    with pytest.raises(OptionsError, match="dtype bfloat16 and device cpu"):
        RuntimeOptions(slot_format="packed")
    with pytest.raises(OptionsError, match="slot_format must be one of expanded, packed"):
        RuntimeOptions(slot_format="int4", dtype="bfloat16")
    with pytest.raises(CompressionError, match="stores no expert compressed"):
        load_offloaded(tiny_moe_dir("mixtral"), dtype="bfloat16", slot_format="packed")
    quantize_model(tiny_moe_dir("mixtral"), tmp_path / "w8", 8)
    with pytest.raises(CompressionError, match="8-bit group-wise symmetric weights; packed slots hold symmetric int4"):
        load_offloaded(tmp_path / "w8", dtype="bfloat16", slot_format="packed")
    quantize_model(tiny_moe_dir("mixtral"), tmp_path / "g16", 4, group_size=16)
    with pytest.raises(CompressionError, match="takes groups of 32, 64, 128, 256 along the input dimension, not 16"):
        load_offloaded(tmp_path / "g16", dtype="bfloat16", slot_format="packed")


def test_bench_compressed_gives_every_model_the_first_models_slot_bytes(int4_model, tmp_path):
    """bf16 and int4 expanded buy the same slots with a budget; int4 packed buys ~3x as many with
    the same bytes; labels name the requested share, so rows compare across models; every run exact."""
    int4 = int4_model("mixtral")
    bf16 = tmp_path / "w16"
    quantize_model(int4.parent / "source", bf16, 16)
    texts = [PROMPT * 4] * 3
    sida = random_sida(int4.parent / "source", tmp_path)
    result = bench_compressed({"bf16": str(bf16), "int4": str(int4), "int4-packed": str(int4)}, texts, [0.25], 1, {},
                              tmp_path / "bench.json", options=RuntimeOptions(dtype="bfloat16"),
                              packed=("int4-packed",), predictor=("sida", str(sida), "mrs"), new_tokens=3,
                              timed_prompts=1, prompt_tokens=6, isolate=False)
    runs = {r["model"]: r for r in result["runs"] if r["label"] == "none+lru@0.25"}
    predicted = {r["model"]: r for r in result["runs"] if r["label"] == "sida+mrs@0.25"}
    # the predictor ran on every forward the prediction guard did not pause (whether its prefetches
    # inserted anything depends on the hash thread's timing and, at int4 packed's near-full budget,
    # on what is resident already)
    assert predicted.keys() == runs.keys()
    assert all(r["stats"]["late_tables"] + r["stats"]["tables_on_time"] + r["stats"]["prediction_paused_forwards"]
               == r["stats"]["forwards"] > 0 for r in predicted.values())
    assert predicted["int4-packed"]["budget"] == runs["int4-packed"]["budget"]
    assert len({r["budget_bytes"] for r in runs.values()}) == 1
    assert runs["bf16"]["budget"] == runs["int4"]["budget"] == 0.25
    assert runs["int4-packed"]["budget"] >= 3 * 0.25
    assert all(r["exact"] for r in result["runs"]) and result["complete"]
    assert result["models"]["int4-packed"]["slot_format"] == "packed"
    assert set(result["summary"]["int4-packed"]) == {"all_resident", "none+lru@0.25", "sida+mrs@0.25"}
    with pytest.raises(BenchError, match="--packed names int8"):
        bench_compressed({"bf16": str(bf16)}, texts, [0.25], 1, {}, tmp_path / "no.json", packed=("int8",))
