"""`prescient quality`: what compressing a model's experts costs in quality, measured as the field
measures it, teacher-forced on held-out text: perplexity of the model and of its reference (the
uncompressed model), the mean next-token KL divergence KL(reference ‖ model), and how often the
two agree on the most likely next token.

Both models compute in `dtype` (float32, or bfloat16 as `--dtype bfloat16` serves them); a
compressed model's experts are expanded as the runtime expands them, and offloading computes
exactly what the resident model computes, so these figures hold for the model served at any
budget in that dtype. With `slot_format="packed"` (int4 experts computed by torch's int4 kernel
from packed slots, in bfloat16) the model runs through the runtime with a slot for every expert,
since that kernel is not what transformers computes with.

JSON: {model, reference, dtype, slot_format, split, seq_len, windows, datasets: {SPEC: {tokens, perplexity,
reference_perplexity, perplexity_increase, kl_nats, top1_agreement}}, fingerprint_match}.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from offload_runtime.engine.loader import load_offloaded
from offload_runtime.engine.options import DTYPES, RuntimeOptions
from prescient.atomic import write_json_atomic
from prescient.fingerprint import fingerprint_model
from prescient.loading import load_model, load_tokenizer
from training.reference_lm import corpus_windows


@torch.no_grad()
def compare_logits(model, reference, windows: torch.Tensor, batch_size: int = 8, desc: str = "") -> dict:
    """Teacher-forced next-token figures of `model` against `reference` over `windows` [N, T]."""
    nll = ref_nll = kl = agree = tokens = 0.0
    for batch in tqdm(windows.split(batch_size), desc=desc or "quality", unit="batch", disable=None):
        targets = batch[:, 1:]
        logp = F.log_softmax(model(batch).logits[:, :-1].float(), dim=-1)
        ref_logp = F.log_softmax(reference(batch).logits[:, :-1].float(), dim=-1)
        nll -= logp.gather(-1, targets.unsqueeze(-1)).sum().item()
        ref_nll -= ref_logp.gather(-1, targets.unsqueeze(-1)).sum().item()
        kl += (ref_logp.exp() * (ref_logp - logp)).sum().item()
        agree += (logp.argmax(-1) == ref_logp.argmax(-1)).sum().item()
        tokens += targets.numel()
    ppl, ref_ppl = math.exp(nll / tokens), math.exp(ref_nll / tokens)
    return {"tokens": int(tokens), "perplexity": round(ppl, 4), "reference_perplexity": round(ref_ppl, 4),
            "perplexity_increase": float(f"{ppl / ref_ppl - 1:.4g}"), "kl_nats": float(f"{kl / tokens:.4g}"),
            "top1_agreement": round(agree / tokens, 5)}


def measure_quality(model_dir: str | Path, reference_dir: str | Path, datasets: tuple[str, ...],
                    split: str = "validation", text_field: str = "text", seq_len: int = 256, windows: int = 64,
                    batch_size: int = 8, dtype: str = "float32", slot_format: str = "expanded") -> dict:
    options = RuntimeOptions(budget=1.0, dtype=dtype, slot_format=slot_format)  # checks the pair
    reference, ref_layers = load_model(reference_dir, dtype=DTYPES[dtype])
    if slot_format == "packed":
        model = load_offloaded(model_dir, options=options)
        fingerprint = model.offload_runtime.fingerprint
    else:
        model, layers = load_model(model_dir, dtype=DTYPES[dtype])
        fingerprint = fingerprint_model(model, layers)
    tokenizer = load_tokenizer(reference_dir)
    result = {"model": str(model_dir), "reference": str(reference_dir), "dtype": dtype, "slot_format": slot_format,
              "split": split, "seq_len": seq_len, "windows": windows,
              "fingerprint_match": fingerprint == fingerprint_model(reference, ref_layers), "datasets": {}}
    try:
        for dataset in datasets:
            held_out = corpus_windows(tokenizer, dataset, split, text_field, seq_len, windows)
            result["datasets"][dataset] = compare_logits(model, reference, held_out, batch_size, desc=dataset)
    finally:
        if slot_format == "packed":
            model.offload_runtime.close()
    return result


def run_quality(json_path: str | Path, **kwargs) -> dict:
    result = measure_quality(**kwargs)
    write_json_atomic(json_path, result)
    return result
