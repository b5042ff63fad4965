"""The "streamed" expert kernel (`expert_kernels.streamed_experts_forward`): each routed expert's
GEMM on its own rows, the k outputs summed in router order. It stands in for transformers'
grouped_mm on the CPU, so it must give grouped_mm's numbers bit for bit: on experts modules of
each layout transformers has (fused gate_up, transposed with biases and interleaved gate/up), at
one token (decode) and many (prefill), in float32 and bfloat16; through the runtime's slots and in
the whole model `--memory` loads, the logits and greedy tokens of the plain model. "gemv" (a decode
row through `rowdot.product`, forced here where the tiny model's shapes would keep torch's `linear`),
in the slots, the whole model and the model mapped from its checkpoint: the plain model's greedy
tokens, its prompt logits bit for bit and its decode logits within 1e-5."""

from __future__ import annotations

import pytest
import torch
from torch.nn.functional import linear as nn_linear
from transformers import GptOssConfig, MixtralConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.mixtral.modeling_mixtral import MixtralExperts

from offload_runtime.engine import expert_kernels, loader, rowdot
from offload_runtime.engine.expert_kernels import GEMV, STREAMED, register_streamed, stands_in
from offload_runtime.engine.loader import load_offloaded, whole_model_memory
from offload_runtime.engine.options import RuntimeOptions
from prescient.loading import load_tokenizer
from tests.runtime.test_exact_offloading import PROMPT, check_exact, decode, model_dir, plain_model  # noqa: F401

EXPERTS = 6


def experts_module(kind: str, dtype: torch.dtype) -> torch.nn.Module:
    """A random experts module of `kind`: Mixtral's (fused [E, 2I, H] gate_up, no bias) or
    GPT-OSS's (transposed [E, H, 2I], biases, gate and up interleaved, its own gating)."""
    torch.manual_seed(0)
    if kind == "mixtral":
        module = MixtralExperts(MixtralConfig(hidden_size=32, intermediate_size=48, num_local_experts=EXPERTS))
    else:
        module = GptOssExperts(GptOssConfig(hidden_size=32, intermediate_size=48, num_local_experts=EXPERTS))
    with torch.no_grad():
        for param in module.parameters():
            param.normal_(0, 0.1)
    return module.to(dtype)


def routed(tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(tokens)
    hidden = torch.randn(tokens, 32, generator=generator).to(dtype)
    probs = torch.softmax(torch.randn(tokens, EXPERTS, generator=generator), dim=-1)
    weights, index = probs.topk(2, dim=-1)
    return hidden, index, weights / weights.sum(dim=-1, keepdim=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["mixtral", "gpt_oss"])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_streamed_is_grouped_mm_bit_for_bit(kind, dtype, tokens):
    register_streamed()
    module = experts_module(kind, dtype)
    hidden, index, weights = routed(tokens, dtype)
    outputs = {}
    with torch.inference_mode():
        for implementation in ("grouped_mm", STREAMED):
            module.config._experts_implementation = implementation
            outputs[implementation] = module(hidden, index, weights)
    assert outputs[STREAMED].dtype == dtype and outputs[STREAMED].abs().sum() > 0
    assert torch.equal(outputs[STREAMED], outputs["grouped_mm"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_streamed_is_exact_at_every_slot_count_and_schedule(model_dir, dtype):
    """Below, at and above the experts a layer routes to, with each expert computed as its copy
    lands and with lookahead: prefill, greedy and sampled decode equal the plain model bit for bit."""
    check_exact(model_dir("reference"), dtype, [2, 5, 16], expert_kernel=STREAMED)


def test_streamed_stands_in_for_grouped_mm_on_the_cpu_only():
    cpu = torch.device("cpu")
    assert stands_in("grouped_mm", cpu)
    assert not stands_in("eager", cpu) and not stands_in("batched_mm", cpu)
    assert not stands_in("grouped_mm", torch.device("cuda"))


@pytest.mark.parametrize("load", ["slots", "memory"])
def test_streamed_runtime_keeps_the_plain_models_logits(tiny_moe_dir, load):
    """Through the slots (5 of the tiny model's experts, every schedule's single call) and in the
    whole model `--memory` loads: prompt logits and every greedy step's logits equal the plain
    model's, and the whole model's experts run "streamed" (with "model", transformers' own)."""
    path = tiny_moe_dir("mixtral")
    ids = load_tokenizer(path)(PROMPT, return_tensors="pt").input_ids
    reference, _ = plain_model(path, "float32")
    assert reference.config._experts_implementation == "grouped_mm"
    with torch.inference_mode():
        want_prefill = reference(ids).logits
    want_tokens, want_logits = decode(reference, ids, sample=False)
    for kernel in (STREAMED, "model"):
        settings = {"budget": "5slots"} if load == "slots" else {"memory": "90%"}
        model = load_offloaded(path, options=RuntimeOptions(expert_kernel=kernel, **settings))
        if load == "memory":
            assert model.config._experts_implementation == (STREAMED if kernel == STREAMED else "grouped_mm")
        with model.runtime:
            with torch.inference_mode():
                assert torch.equal(model(ids).logits, want_prefill), kernel
            tokens, logits = decode(model, ids, sample=False)
        assert torch.equal(tokens, want_tokens), kernel
        assert torch.equal(logits, want_logits), kernel


def test_gemv_keeps_greedy_tokens_and_logits_within_1e_5(tiny_moe_dir, monkeypatch):
    """The default kernel ("gemv") with `rowdot.product` forced on the tiny model's small matrices."""
    assert RuntimeOptions().expert_kernel == GEMV
    monkeypatch.setattr(rowdot, "LEAST_BYTES", 0)
    calls = []
    product = rowdot.product
    monkeypatch.setattr(rowdot, "product", lambda x, weight: calls.append(1) or product(x, weight))
    path = tiny_moe_dir("mixtral")
    ids = load_tokenizer(path)(PROMPT, return_tensors="pt").input_ids
    reference, _ = plain_model(path, "float32")
    with torch.inference_mode():
        want_prefill = reference(ids).logits
    want_tokens, want_logits = decode(reference, ids, sample=False)
    for settings in ({"budget": "5slots"}, {"memory": "90%"}, {"memory": "90%", "map_experts": True}):
        model = load_offloaded(path, options=RuntimeOptions(**settings))
        with model.runtime:
            with torch.inference_mode():
                assert torch.equal(model(ids).logits, want_prefill), settings
            tokens, logits = decode(model, ids, sample=False)
        assert torch.equal(tokens, want_tokens), settings
        assert (logits - want_logits).abs().max() < 1e-5, settings
        assert calls, settings  # the decode rows ran our product
        calls.clear()


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_rowdot_is_linear_within_rounding_whatever_the_threads(threads):
    """A row against a matrix at any thread count: `linear`'s numbers within float32 rounding, and
    the same numbers at every thread count (each row is summed by one thread, the same loop)."""
    generator = torch.Generator().manual_seed(0)
    weight, x = torch.randn(301, 515, generator=generator), torch.randn(1, 515, generator=generator)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = rowdot.product(x, weight)
        torch.set_num_threads(threads)
        out = rowdot.product(x, weight)
    finally:
        torch.set_num_threads(previous)
    assert out.shape == (1, 301) and torch.equal(out, one)
    assert torch.allclose(out, nn_linear(x, weight), rtol=1e-5, atol=1e-5)


def test_rowdot_streams_wide_contiguous_float32_cpu_matrices_only(monkeypatch):
    monkeypatch.setattr(rowdot, "LEAST_BYTES", 4096)
    wide = torch.zeros(32, 64)  # 8 KiB
    assert rowdot.streams(wide)
    assert not rowdot.streams(torch.zeros(8, 64))  # under LEAST_BYTES
    assert not rowdot.streams(wide.t())  # not contiguous
    assert not rowdot.streams(wide.to(torch.bfloat16)) and not rowdot.streams(wide.double())


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_gemv_in_half_precision_is_streamed_bit_for_bit(tiny_moe_dir, dtype):
    """The default kernel in bfloat16 (the runtime's other dtype) runs no row kernel: each
    routed expert's GEMM through torch's `linear`, the plain model's logits bit for bit."""
    path = tiny_moe_dir("mixtral")
    ids = load_tokenizer(path)(PROMPT, return_tensors="pt").input_ids
    reference, _ = plain_model(path, dtype)
    want_tokens, want_logits = decode(reference, ids, sample=False)
    for settings in ({"budget": "5slots"}, {"memory": "90%"}):
        model = load_offloaded(path, options=RuntimeOptions(dtype=dtype, **settings))
        with model.runtime:
            tokens, logits = decode(model, ids, sample=False)
        assert torch.equal(tokens, want_tokens) and torch.equal(logits, want_logits), settings
    for half in (torch.bfloat16, torch.float16):  # float16: the plain model's dtype where a user loads it so
        assert not rowdot.streams(torch.zeros(1024, 1024, dtype=half))


def test_the_memory_plan_books_the_row_kernels_workspace_for_gemv_only(tiny_moe_dir, monkeypatch):
    """Where an expert matrix may reach `rowdot.LEAST_BYTES` (here: the floor lowered under the tiny
    model's), float32 "gemv" books `rowdot.WORKSPACE`; bfloat16, our other kernels and smaller
    matrices book nothing."""
    path = tiny_moe_dir("mixtral")
    monkeypatch.setattr(loader, "process_footprint", lambda reads=True: 2**28)  # the same process in each estimate
    need = {kernel: whole_model_memory(path, RuntimeOptions(expert_kernel=kernel)) for kernel in (GEMV, "model")}
    assert need[GEMV] == need["model"]  # the tiny model's matrices stay under the floor
    monkeypatch.setattr(rowdot, "LEAST_BYTES", 1)
    gemv, model = (whole_model_memory(path, RuntimeOptions(expert_kernel=kernel)) for kernel in (GEMV, "model"))
    assert gemv - model == rowdot.WORKSPACE
    book = expert_kernels.kernel_workspace_bytes
    assert book(GEMV, torch.bfloat16, "cpu", 2**30) == book(STREAMED, torch.float32, "cpu", 2**30) == 0
    assert book("model", torch.float32, "cpu", 2**30) == book(GEMV, torch.float32, "cuda", 2**30) == 0
