"""`prescient bench-kernels`: EPS-MoE's load-aware expert kernels against the model's own, in the
batch path.

1. The crossover on this machine for the model's layer shape (`expert_kernels.measure_crossover`:
   transformers' eager loop, batched_mm and grouped_mm timed at each load of tokens per activated
   expert, random weights): the fastest kernel per load and the load from which the per-expert
   pipeline pays. The table is saved in the results JSON (under "crossover"), which
   `--expert-kernel-table` reads; the "auto" runs below use it.
2. Klotski's batch decoder (`KlotskiPipe`, run as `experiments.bench_batch.measure_schedule` runs
   it: a fresh runtime at the budget r_w needs) at each policy N:μ:r_w with `expert_kernel`
   "model" and "auto", in interleaved repeats (model, auto, model, auto, ...): end-to-end and
   decode tokens/s, and the seconds spent inside the experts modules (`experts_seconds`, copy
   waits included; `stall_seconds` is the runtime's time blocked on copies); every output checked
   token for token against each request generated alone by the plain model.
3. The logits check, "model" and "auto" against the plain model (all experts in slots): one
   forward over every prompt at once (many tokens per expert) and the first prompt generated
   greedily (one per expert), bit-equality and the largest logit difference.

The JSON is rewritten after every run (an interrupted bench keeps what it measured); the summary
gives, per policy, medians and spreads and the ratio auto/model of the medians with the range of
the paired ratios (repeat by repeat).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from experiments.bench_batch import BATCH_OPTIONS, BatchPolicy
from experiments.bench_batch_shared import ARMS, hot_ranking, median_spread
from offload_runtime.engine.options import RuntimeOptions
from prescient.atomic import write_json_atomic

log = logging.getLogger(__name__)



@contextmanager
def experts_timer() -> Any:
    """Seconds spent inside fused offloaded experts modules while the block runs (global module
    hooks: the bench does not reach into the modules a run builds)."""
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    from offload_runtime.engine.offloaded_experts import OffloadedExperts

    spent = {"seconds": 0.0, "calls": 0}
    started: list[float] = []

    def before(module, _inputs):
        if isinstance(module, OffloadedExperts):
            started.append(time.perf_counter())

    def after(module, _inputs, _output):
        if isinstance(module, OffloadedExperts):
            spent["seconds"] += time.perf_counter() - started.pop()
            spent["calls"] += 1

    handles = [register_module_forward_pre_hook(before), register_module_forward_hook(after)]
    try:
        yield spent
    finally:
        for handle in handles:
            handle.remove()


def layer_crossover(plain, layers, repeats: int):
    """The crossover table on layer 0's shapes (every layer of the model shares them)."""
    from offload_runtime.engine.expert_kernels import measure_crossover

    layer = layers[0]
    return measure_crossover(layer.experts, experts=layer.num_experts, top_k=layer.top_k, repeats=repeats)


def logits_check(model_dir: str, plain, prompts: list[list[int]], gen_len: int, options: RuntimeOptions
                 ) -> dict[str, Any]:
    """The runtime of `options` against `plain` (its weights in memory of their own, see
    `own_memory`): the logits of one forward over every prompt at once, left-padded (many tokens
    per expert: the large-load kernels), at the real positions; and the first prompt generated
    greedily (one token per expert and step): equal tokens, equal logits, the largest difference."""
    import torch

    from offload_runtime.engine.loader import load_offloaded

    pad = plain.config.pad_token_id or 0
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def run(model):
        with torch.inference_mode():
            batch = model(input_ids=ids, attention_mask=mask).logits[mask.bool()]
            out = model.generate(torch.tensor([prompts[0]]), max_new_tokens=gen_len, min_new_tokens=gen_len,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=pad)
        return batch, out.sequences, torch.stack(out.logits)

    want_batch, want_tokens, want_logits = run(plain)
    model = load_offloaded(model_dir, None, options)
    with model.runtime:
        batch, tokens, logits = run(model)
    return {"expert_kernel": options.expert_kernel, "budget": options.budget.as_json(), "batch_prompts": len(prompts),
            "batch_logits_equal": bool(torch.equal(batch, want_batch)),
            "batch_max_logit_difference": float((batch - want_batch).abs().max()),
            "tokens_equal": bool(torch.equal(tokens, want_tokens)), "logits_equal": bool(torch.equal(logits, want_logits)),
            "max_logit_difference": float((logits - want_logits).abs().max())}


def own_memory(model) -> None:
    """Every weight of `model` copied into memory of its own: `from_pretrained` may leave a weight
    at any offset of a memory-mapped file, and a float32 GEMM's rounding can depend on its operands'
    alignment (the runtime's loader copies); without this the plain model differs from itself."""
    for param in model.parameters():
        param.data = param.data.clone()


def bench_kernels(model_dir: str, json_path: str, policies: list[BatchPolicy], repeats: int = 3, gen_len: int = 8,
                  shortest: int = 16, longest: int = 48, trace: str | None = None, threads: int = 1,
                  options: RuntimeOptions = BATCH_OPTIONS, dataset: str = "stdlib-code", split: str = "validation",
                  crossover_repeats: int = 3, command: str | None = None,
                  arms: tuple[str, ...] = ("model", "auto")) -> dict[str, Any]:
    """See the module doc; `arms`: which of `ARMS` run, model first."""
    import json
    import tempfile

    import torch

    from experiments.bench_batch import correlation_table, measure_schedule, request_prompts
    from experiments.bench_batch_resident import reference_outputs
    from experiments.machine import machine_info
    from prescient.fingerprint import fingerprint_model
    from prescient.loading import load_model, load_tokenizer

    torch.set_num_threads(threads)
    prompts = request_prompts(load_tokenizer(model_dir), max(p.requests for p in policies), shortest, longest,
                              dataset, split)
    result: dict[str, Any] = {
        "command": command, "machine": machine_info(threads),
        "settings": {"model": model_dir, "policies": [p.label for p in policies], "repeats": repeats,
                     "gen_len": gen_len, "prompt_tokens": [shortest, longest], "dataset": f"{dataset}:{split}",
                     "schedule": "klotski", "arms": {arm: ARMS[arm] for arm in arms}, "hot_ranking": trace or "expert id",
                     "correlation_table": trace or "empty, online", "options": options.to_json()},
        "runs": [],
    }

    def save() -> None:
        write_json_atomic(Path(json_path), result)

    plain, layers = load_model(model_dir, dtype=torch.float32)
    own_memory(plain)
    result["settings"]["model_experts_implementation"] = plain.config._experts_implementation
    start = time.perf_counter()
    result["crossover"] = layer_crossover(plain, layers, crossover_repeats).to_json()
    result["crossover_seconds"] = round(time.perf_counter() - start, 2)
    log.info("crossover (%.1f s): %s; pipeline from %s tokens per expert", result["crossover_seconds"],
             dict(zip(result["crossover"]["loads"], result["crossover"]["kernels"])),
             result["crossover"]["pipeline_from"])
    save()  # the "auto" runs read their table from this file
    auto = dataclasses.replace(options, expert_kernel="auto", expert_kernel_table=str(json_path))
    scratch = tempfile.TemporaryDirectory()  # auto-pipelined's table: the crossover with the pipeline at every load
    always = Path(scratch.name) / "pipelined.json"
    always.write_text(json.dumps({**result["crossover"], "pipeline_from": 0.0}))
    arm_options = {"model": options, "auto": auto,
                   "auto-pipelined": dataclasses.replace(auto, expert_kernel_table=str(always))}
    fingerprint = fingerprint_model(plain, layers)
    hot = hot_ranking(fingerprint, trace)
    table = correlation_table(trace, None, fingerprint)
    reference = reference_outputs(plain, prompts, gen_len)
    result["logits_check"] = [logits_check(model_dir, plain, prompts, gen_len, dataclasses.replace(arm, budget=1.0))
                              for arm in (options, auto)]
    del plain, layers
    save()

    for repeat in range(repeats):  # interleaved: model, auto at each policy, then again
        for policy in policies:
            for arm in arms:
                with experts_timer() as spent:
                    run = measure_schedule(model_dir, prompts, gen_len, policy, "klotski", reference, hot,
                                           arm_options[arm], table)
                run.update(arm=arm, repeat=repeat, experts_seconds=round(spent["seconds"], 4),
                           experts_calls=spent["calls"])
                result["runs"].append(run)
                log.info("%s %s (repeat %d): %.2f tokens/s end to end, %.2f decode, experts %.2f s, exact %s",
                         policy.label, arm, repeat, run["tokens_per_s"], run["decode_tokens_per_s"],
                         run["experts_seconds"], run["exact"])
                save()
    scratch.cleanup()
    result["summary"] = summary(result["runs"], policies, arms)
    save()
    return result


def summary(runs: list[dict[str, Any]], policies: list[BatchPolicy], arms: tuple[str, ...]) -> dict[str, Any]:
    """Per policy and arm, medians and spreads; each other arm over model, of the medians and of
    each repeat's pair ("auto_over_model", "auto-pipelined_over_model")."""
    keys = ("tokens_per_s", "decode_tokens_per_s", "experts_seconds", "stall_seconds")
    by_policy = {}
    for policy in policies:
        mine = [r for r in runs if r["label"] == policy.label]
        spreads = {arm: {key: median_spread([r[key] for r in mine if r["arm"] == arm]) for key in keys}
                   for arm in arms}
        row = {**asdict(policy), "arms": spreads, "exact": all(r["exact"] for r in mine)}
        for arm in arms[1:]:
            ratios = {}
            for key in ("tokens_per_s", "decode_tokens_per_s"):
                of = {(r["repeat"], r["arm"]): r[key] for r in mine}
                paired = [of[rep, arm] / of[rep, "model"] for rep in sorted({r["repeat"] for r in mine})
                          if (rep, arm) in of and (rep, "model") in of]
                ratios[key] = {"ratio_of_medians": spreads[arm][key]["median"] / spreads["model"][key]["median"],
                               "paired": median_spread(paired)}
            row[f"{arm}_over_model"] = ratios
        by_policy[policy.label] = row
    return {"by_policy": by_policy, "all_exact": all(r["exact"] for r in runs)}
