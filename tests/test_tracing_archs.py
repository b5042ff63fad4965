"""`prescient trace` on architectures beyond the first eight, built tiny from the installed
transformers: a router inside the decoder layer that returns probabilities (Gemma 4), experts
called without ids (Llama 4), a hybrid Mamba model with one MoE layer and shared experts
(Nemotron-H), top-1 with a skip expert (Zaya). Each trace row holds the experts the model's own
experts module ran for that token; LongCat-Flash's zero-computation experts are refused."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from prescient.arch import find_moe_layers
from prescient.arch_zoo import moe_families, save_tiny_model
from prescient.errors import TraceError
from prescient.traces import load_trace
from training.tracing import trace_model

FAMILIES = {"gemma4_text": (4, 2), "llama4_text": (4, 2), "nemotron_h": (1, 2), "zaya": (4, 1)}  # (MoE layers, k)


def tiny_dir(model_type: str, tokenizer, path):
    family = next(f for f in moe_families() if f.model_type == model_type)
    save_tiny_model(family, path)
    tokenizer.save_pretrained(path)
    return path


def experts_ran(model, ids: torch.Tensor) -> torch.Tensor:
    """[n, L, k] sorted expert ids each MoE layer's experts module received for one window."""
    layers, seen = find_moe_layers(model), []

    def record(layer):
        def hook(_module, args):
            if layer.adapter.name == "dense":  # a row block per expert, zero where not chosen
                rows = args[0].view(layer.num_experts, ids.shape[1], -1)
                chosen = rows.ne(0).any(-1).T.float()
                seen.append(chosen.topk(layer.top_k, dim=-1).indices)
            else:
                seen.append(args[1].reshape(ids.shape[1], -1))
        return hook

    handles = [layer.experts.register_forward_pre_hook(record(layer)) for layer in layers]
    with torch.no_grad():
        model(input_ids=ids)
    for handle in handles:
        handle.remove()
    return torch.stack(seen, dim=1).sort(-1).values


@pytest.mark.parametrize("model_type", FAMILIES)
def test_trace_rows_are_the_experts_the_model_ran(model_type, tiny_tokenizer, text_corpus, tmp_path):
    path = tiny_dir(model_type, tiny_tokenizer, tmp_path / "model")
    out = trace_model(path, f"json:{text_corpus}", tmp_path / "trace", split="train", max_tokens=200, top_t=4,
                      seq_len=24, batch_size=4, shard_sequences=4)
    trace = load_trace(out)
    n_layers, k = FAMILIES[model_type]
    fp = trace.fingerprint
    assert (fp.arch, fp.n_moe_layers, fp.n_experts, fp.top_k) == (model_type, n_layers, 8, k)
    assert trace["topk_ids"].shape == (len(trace), n_layers, k) and trace["topt_ids"].shape[-1] == 4
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rows = trace.sequences()[0]
    want = experts_ran(model, trace["token_id"][rows].unsqueeze(0))
    assert torch.equal(trace["topk_ids"][rows].long().sort(-1).values, want)


def test_zero_computation_experts_are_refused_for_tracing(tiny_tokenizer, text_corpus, tmp_path):
    path = tiny_dir("longcat_flash", tiny_tokenizer, tmp_path / "model")
    with pytest.raises(TraceError, match="longcat_flash: MoE layer .* zero-computation expert.*cannot be traced"):
        trace_model(path, f"json:{text_corpus}", tmp_path / "trace", split="train", max_tokens=200, seq_len=24)
