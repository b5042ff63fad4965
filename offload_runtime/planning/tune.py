"""`prescient tune`: measure on this machine which configuration decodes fastest at a few memory
sizes, and keep it as the default (`tuned`).

What decides speed here, measured rather than assumed:
1. the random-read curve at the expert's size (`link_profile.measure_random_reads`): its best
   queue depth is the candidate depth of each read (split into that many reads at once) and number
   of transfer workers (experts read at once, each with a buffer);
2. per memory size (default: 40%, 60% and 80% of what the whole model needs, `whole_model_memory`),
   a short greedy decode of a real prompt for the starting configuration, then for each mechanism
   in turn — each read split at that depth, transfer workers at that depth, the other serving policy, cross-token prefetch
   (SiDA's forecasts one token ahead), in-token lookahead (HybriMoE's next-layer routers), the
   layer waiting for all its copies instead of the expert pipeline — the configuration with that
   change, and last the experts mapped from the checkpoint with the page cache as their cache instead
   of slots (`mapped`; what llama.cpp's mmap runs do), each interleaved with the best so far (A B A B).
   A change is kept when its median tokens/s beats every run of the best so far (a gain within the
   spread is not a gain).
Every run decodes through `generate_offloaded` with `RuntimeOptions(memory=size, ...)` in a fresh
process (forked from one that imported torch and transformers once), so the memory plan, the
page-cache handling and the predictor are those `generate` will use, and no run inherits the heap
an earlier one left behind.
"""

from __future__ import annotations

import multiprocessing
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from offload_runtime.engine.generate import generate_offloaded
from offload_runtime.engine.loader import whole_model_memory
from offload_runtime.engine.options import RuntimeOptions, best_policy
from offload_runtime.planning.link_profile import measure_random_reads, model_read_file
from offload_runtime.planning.tuned import TUNED_SETTINGS, machine_key
from prescient.errors import CapacityError
from prescient.model_dir import ModelDirectory

DEFAULT_SHARES = (0.4, 0.6, 0.8)  # of the whole model's memory: where offloading decides speed
PRELOAD = ["torch", "transformers", "offload_runtime.engine.generate"]  # imported once, in the fork server

Decode = Callable[[str, str, int, "str | None", RuntimeOptions], dict[str, Any]]


def decode_in_child(model_dir: str, prompt: str, new_tokens: int, predictor: str | None,
                    options: RuntimeOptions) -> dict[str, Any]:
    """`generate_offloaded` in a process of its own: tokens/s, statistics and memory plan."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    with context.Pool(1, maxtasksperchild=1) as pool:
        return pool.apply(_decode, (model_dir, prompt, new_tokens, predictor, options))


def _decode(model_dir: str, prompt: str, new_tokens: int, predictor: str | None,
            options: RuntimeOptions) -> dict[str, Any]:
    result = generate_offloaded(model_dir, prompt, new_tokens, predictor=predictor, options=options)
    return {key: result[key] for key in ("tokens_per_s", "stats", "memory_plan")}


def starting_settings(predictor: str | Path | None) -> dict[str, Any]:
    """The built-in defaults, where tuning starts."""
    return {"transfer_workers": 1, "read_depth": 1, "policy": best_policy(predictor), "next_token_min_chance": None,
            "lookahead_layers": 0, "expert_pipeline": True, "map_experts": None}


def candidate_changes(depth: int, forecasts: bool) -> list[tuple[str, dict[str, Any]]]:
    """Each mechanism's change to try on top of the best so far, in order."""
    changes = [("parallel reads", {"read_depth": depth}), ("transfer workers", {"transfer_workers": depth})] \
        if depth != 1 else []
    if forecasts:
        changes += [("policy lru", {"policy": "lru"}), ("cross-token prefetch", {"next_token_min_chance": 0.5})]
    changes += [("in-token lookahead", {"lookahead_layers": 1}), ("serial layers", {"expert_pipeline": False})]
    return changes + [("mapped experts", {"map_experts": True})]  # last: mapped, the slots' settings do not matter


def tune(model_dir: str | Path, predictor: str | Path | None = None, memories: list[int] | None = None,
         new_tokens: int = 48, repeats: int = 2, prompt: str | None = None,
         on_size: Callable[[dict[str, Any]], None] | None = None, decode: Decode = decode_in_child) -> dict[str, Any]:
    """The tuning record: the read curve, every run, and per size the best settings (see the module
    doc); `on_size(record)` after each size, so that a stopped tuning keeps the sizes it finished;
    `decode` runs one configuration (a fresh process by default)."""
    directory = ModelDirectory.of(model_dir)
    curve = measure_random_reads(*model_read_file(directory), repeats=2)
    forecasts = predictor is not None and best_policy(predictor) == "learned-belady"
    sizes = memories or [int(share * whole_model_memory(directory)) for share in DEFAULT_SHARES]
    prompt = prompt or default_prompt()
    changes = candidate_changes(curve.depth, forecasts)
    record: dict[str, Any] = {
        "model": str(directory), "predictor": predictor and str(predictor), "machine": machine_key(),
        "new_tokens": new_tokens, "repeats": repeats, "prompt": prompt,
        "read_curve": {"expert_bytes": curve.expert_bytes, "depths": list(curve.depths),
                       "bytes_per_s": list(curve.bytes_per_s), "depth": curve.depth},
        "best": [], "runs": [], "refused": []}
    bar = tqdm(total=len(sizes) * (1 + len(changes)) * repeats * 2, desc="tune", unit="run", disable=None)

    def run(memory: int, settings: dict[str, Any]) -> float:
        result = decode(str(directory), prompt, new_tokens, predictor and str(predictor),
                        RuntimeOptions(memory=memory, **settings))
        record["runs"].append({"memory": memory, "settings": settings, "tokens_per_s": result["tokens_per_s"],
                               "stats": result["stats"], "memory_plan": result["memory_plan"]})
        bar.update()
        return result["tokens_per_s"]

    for memory in sizes:
        try:
            best = _best_at(memory, starting_settings(predictor), changes, repeats, run)
        except CapacityError as exc:
            record["refused"].append({"memory": memory, "why": str(exc)})
            continue
        record["best"].append({"memory": memory, **best})
        if on_size is not None:
            on_size(record)
    bar.close()
    return record


def _best_at(memory: int, start: dict[str, Any], changes: list[tuple[str, dict[str, Any]]], repeats: int,
             decode: Callable[[int, dict[str, Any]], float]) -> dict[str, Any]:
    """Coordinate search at one size: each change against the best so far, interleaved."""
    best, best_runs, kept = start, [], []
    for name, change in changes:
        trial = {**best, **change}
        if trial == best:
            continue
        trial_runs = []
        for _ in range(repeats):  # A B A B: the best so far and the trial, in turn
            best_runs.append(decode(memory, best))
            trial_runs.append(decode(memory, trial))
        if statistics.median(trial_runs) > max(best_runs):  # a gain within the best's spread is no gain
            best, best_runs = trial, trial_runs
            kept.append(name)
    if not best_runs:  # nothing to try: measure the start once for the record
        best_runs = [decode(memory, best) for _ in range(repeats)]
    return {"settings": {k: best[k] for k in TUNED_SETTINGS}, "kept": kept,
            "tokens_per_s": statistics.median(best_runs), "spread": [min(best_runs), max(best_runs)]}


def default_prompt(tokens: int = 48) -> str:
    """A real prompt: the start of a held-out row of the built-in stdlib-code corpus."""
    from training.corpora import load_corpus

    text = next(row for row in load_corpus("stdlib-code", "validation")["text"] if len(row) > 8 * tokens)
    return text[: 4 * tokens]
