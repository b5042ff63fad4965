"""`prescient quality`: what compressing a model's experts costs in quality, measured as the field
measures it, teacher-forced on held-out text: perplexity of the model and of its reference (the
uncompressed model), the mean next-token KL divergence KL(reference ‖ model), and how often the
two agree on the most likely next token.

With `offload` (`--memory` or `--budget`) both models run through the offloading runtime, neither
whole in memory. Under `--memory` the cap is the whole process's, both models in it: the reference,
loaded first, is planned for half of what the process has left, and the model for the rest. Both
models compute in `dtype` (float32, or bfloat16 as `--dtype bfloat16` serves them); a compressed
model's experts are expanded as the runtime expands them, and offloading computes exactly what the
resident model computes, so these figures hold for the model served at any budget in that dtype.
With `slot_format="packed"` (int4 experts computed by torch's int4 kernel from packed slots, in
bfloat16) the model runs through the runtime, since that kernel is not what transformers computes
with.

Mixed precision (`options.fine_model`) computes each expert with the copy the runtime chose for
it, so its quality depends on the budget, policy, predictor and rule: it runs through the runtime
with those, in decode mode (`decode=True`, implied): teacher-forced one token per forward, as a
served sequence decodes, the cache's state carried from token to token; the reference decodes
alike. Decode mode is open to any model, so that uniform precisions compare on the same footing.

JSON: {model, reference, dtype, slot_format, options, predictor, decode, split, seq_len, windows, datasets: {SPEC:
{tokens, perplexity, reference_perplexity, perplexity_increase, kl_nats, top1_agreement, fine_share?}},
fingerprint_match, memory_plans?: {reference, model}}; memory_plans: with `--memory`, what each model's share
bought (`MemoryPlan.line`); fine_share: mixed precision's share of expert uses computed with a fine copy.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from offload_runtime.engine.loader import load_offloaded
from offload_runtime.engine.options import RuntimeOptions
from prescient.atomic import write_json_atomic
from prescient.fingerprint import loaded_fingerprint
from prescient.loading import load_model, load_tokenizer
from prescient.memory_cap import process_footprint
from training.reference_lm import corpus_windows


@torch.no_grad()
def decoded_logits(model, batch: torch.Tensor) -> torch.Tensor:
    """The logits of `batch` [B, T] teacher-forced one token per forward, with the KV cache."""
    out = model(batch[:, :1], use_cache=True)
    logits, cache = [out.logits], out.past_key_values
    for t in range(1, batch.shape[1]):
        out = model(batch[:, t:t + 1], past_key_values=cache, use_cache=True)
        logits.append(out.logits)
        cache = out.past_key_values
    return torch.cat(logits, dim=1)


@torch.no_grad()
def compare_logits(model, reference, windows: torch.Tensor, batch_size: int = 8, desc: str = "",
                   decode: bool = False) -> dict:
    """Teacher-forced next-token figures of `model` against `reference` over `windows` [N, T];
    `decode`: one token per forward (see the module doc)."""
    nll = ref_nll = kl = agree = tokens = 0.0
    run = decoded_logits if decode else (lambda m, batch: m(batch).logits)
    for batch in tqdm(windows.split(batch_size), desc=desc or "quality", unit="batch", disable=None):
        targets = batch[:, 1:]
        logp = F.log_softmax(run(model, batch)[:, :-1].float(), dim=-1)
        ref_logp = F.log_softmax(run(reference, batch)[:, :-1].float(), dim=-1)
        nll -= logp.gather(-1, targets.unsqueeze(-1)).sum().item()
        ref_nll -= ref_logp.gather(-1, targets.unsqueeze(-1)).sum().item()
        kl += (ref_logp.exp() * (ref_logp - logp)).sum().item()
        agree += (logp.argmax(-1) == ref_logp.argmax(-1)).sum().item()
        tokens += targets.numel()
    ppl, ref_ppl = math.exp(nll / tokens), math.exp(ref_nll / tokens)
    return {"tokens": int(tokens), "perplexity": round(ppl, 4), "reference_perplexity": round(ref_ppl, 4),
            "perplexity_increase": float(f"{ppl / ref_ppl - 1:.4g}"), "kl_nats": float(f"{kl / tokens:.4g}"),
            "top1_agreement": round(agree / tokens, 5)}


def _loaded(model_dir: str | Path, predictor: str | None, options: RuntimeOptions, offload: bool):
    """(model, its fingerprint): through the runtime with `options` when `offload`, else whole in
    `options.dtype`."""
    if offload:
        model = load_offloaded(model_dir, predictor, options=options)
        return model, model.runtime.fingerprint
    model, layers = load_model(model_dir, dtype=options.torch_dtype)
    return model, loaded_fingerprint(model_dir, model, layers, options.torch_dtype)


def reference_share(cap: int) -> int:
    """The cap the reference is planned for when both models share `cap` in this process: half of
    what the process leaves now (the model, loaded after it, measures the process with the
    reference in it and takes the rest)."""
    now = process_footprint()
    return now + max(cap - now, 0) // 2


def measure_quality(model_dir: str | Path, reference_dir: str | Path, datasets: tuple[str, ...],
                    split: str = "validation", text_field: str = "text", seq_len: int = 256, windows: int = 64,
                    batch_size: int = 8, options: RuntimeOptions | None = None, predictor: str | None = None,
                    decode: bool = False, offload: bool = False) -> dict:
    """`options`: the dtype both compute in, and (packed slots, mixed precision) how the runtime
    serves the model; `predictor`: the runtime's (an artifact path). `offload`: both models run
    through the runtime with `options` (experts in `options.budget` worth of slots, read from
    `options.store`; or with `options.memory`, the two of them under that cap), so that neither needs its
    whole weights in memory; the figures are those of the whole models (offloading computes what they
    compute)."""
    options = options or RuntimeOptions(budget=1.0)
    mixed = options.fine_model is not None
    decode = decode or mixed
    through_runtime = offload or options.slot_format == "packed"
    ref_options = replace(options, slot_format="expanded", fine_model=None)
    if offload and options.memory is not None:
        ref_options = replace(ref_options, memory=reference_share(options.memory))
    reference, ref_fingerprint = _loaded(reference_dir, None, ref_options, offload)
    model, fingerprint = _loaded(model_dir, predictor, options, through_runtime)
    tokenizer = load_tokenizer(reference_dir)
    result = {"model": str(model_dir), "reference": str(reference_dir), "dtype": options.dtype,
              "slot_format": options.slot_format, "options": options.to_json() if through_runtime else None,
              "predictor": str(predictor) if predictor else None, "decode": decode,
              "split": split, "seq_len": seq_len, "windows": windows,
              "fingerprint_match": fingerprint == ref_fingerprint, "datasets": {}}
    if offload and options.memory is not None:
        result["memory_plans"] = {name: loaded.runtime.memory_plan.line()
                                  for name, loaded in (("reference", reference), ("model", model))}
    try:
        for dataset in datasets:
            held_out = corpus_windows(tokenizer, dataset, split, text_field, seq_len, windows)
            before = model.runtime.stats() if mixed else None
            figures = compare_logits(model, reference, held_out, batch_size, desc=dataset, decode=decode)
            if mixed:
                after = model.runtime.stats()
                figures["fine_share"] = round((after.fine_accesses - before.fine_accesses)
                                              / max(after.accesses - before.accesses, 1), 4)
            result["datasets"][dataset] = figures
    finally:
        for loaded, offloaded in ((model, through_runtime), (reference, offload)):
            if offloaded:
                loaded.runtime.close()
    return result


def run_quality(json_path: str | Path, **kwargs) -> dict:
    result = measure_quality(**kwargs)
    write_json_atomic(json_path, result)
    return result
