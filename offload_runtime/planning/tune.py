"""`prescient tune`: measure on this machine which configuration decodes fastest at a few memory
sizes, and keep it as the default (`tuned`).

What decides speed here, measured rather than assumed:
1. the random-read curve at the expert's size (`link_profile.measure_random_reads`): its best
   queue depth is the candidate depth of each read (split into that many reads at once) and number
   of transfer workers (experts read at once, each with a buffer);
2. per memory size (default: 40%, 60% and 80% of what the whole model needs, `whole_model_memory`),
   short greedy decodes of a few held-out prompts (one load, the prompts in turn, as a server meets
   requests) for the starting configuration, then for each mechanism in turn — each read split at that depth, transfer workers at that depth, the other serving policy, cross-token prefetch
   (SiDA's forecasts one token ahead), in-token lookahead (HybriMoE's next-layer routers), the
   layer waiting for all its copies instead of the expert pipeline, the runtime without its predictor
   (`use_predictor=False`: where LRU already hits well a predictor can cost more than it saves) — the configuration with that
   change, and last the experts mapped from the checkpoint with the page cache as their cache instead
   of slots (`mapped`; what llama.cpp's mmap runs do), each interleaved with the best so far (A B A B).
   A change is kept when the paired statistic says it wins beyond the spread: per prompt, its median
   tokens/s over the best's median interleaved with it; the geometric mean of those ratios over the
   prompts must exceed the best's own spread (slowest run against fastest, per prompt, likewise
   averaged). One prompt is not a workload (LRU kept on one prompt at 0.65 GB decoded another at
   half the speed, `results/tune-tb.json` as of 27b8128), and "wins on every prompt", the rule
   before, kept almost nothing with this machine's ±20% spread (`results/tune-tw.json`).
Every run decodes through `generate_offloaded` with `RuntimeOptions(memory=size, ...)` in a fresh
process, so the memory plan, the page-cache handling and the predictor are those `generate` will
use, and no run inherits the heap an earlier one left behind. Where this machine has a writable
memory cgroup, each run is a new process in a cgroup capped at the size, the page cache dropped
before it (as `bench --memory` runs): the kernel then holds the size as it holds it for a user,
page cache included, and a configuration that outgrows it is killed and scores 0. Elsewhere the
runs fork from one process that imported torch once, uncapped, and mapped experts are not tried
(with no cgroup nothing holds their page cache to the size: they would be measured with every
expert cached); `--memory`'s own rule then decides mapping.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import pickle
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from offload_runtime.engine.compiled import compile_ahead
from offload_runtime.engine.generate import generate_offloaded
from offload_runtime.engine.loader import whole_model_memory
from offload_runtime.engine.options import RuntimeOptions
from offload_runtime.engine.resolve import best_policy
from offload_runtime.planning.link_profile import measure_random_reads, model_read_file
from offload_runtime.engine.tuned import TUNED_SETTINGS, machine_key
from offload_runtime.planning.tune_child import decode as decode_here
from prescient.capped_run import cgroup_kind, drop_page_cache, run_capped
from prescient.errors import CapacityError, PrescientError
from prescient.model_dir import ModelDirectory

log = logging.getLogger(__name__)

DEFAULT_SHARES = (0.4, 0.6, 0.8)  # of the whole model's memory: where offloading decides speed
PRELOAD = ["torch", "transformers", "offload_runtime.engine.generate"]  # imported once, in the fork server
RUN_TIMEOUT_S = 600  # the first calibration run at a size; past it the run is stopped and scores 0
SLOWER_LIMIT = 3  # later runs are stopped (and score 0) past this many times the fastest run at the size,
MIN_LIMIT_S = 60  # or this, whichever is longer: serial layers ran past 600 s at 1.1 GB on runs/tw
# the transfer workers tried: each holds an expert-sized buffer, and one read split at the curve's
# depth already reaches its rate (16 workers at 0.65 GB took 15 of 19 slots, results/tune-tb.json at 27b8128)
TRIED_WORKERS = 2

Decode = Callable[..., dict[str, Any]]  # (model_dir, prompts, new_tokens, predictor, options, timeout_s)


class TuneError(PrescientError):
    """A calibration decode that failed (not for want of memory: that scores 0)."""


def decode_in_child(model_dir: str, prompts: list[str], new_tokens: int, predictor: str | None,
                    options: RuntimeOptions, timeout_s: float = RUN_TIMEOUT_S) -> dict[str, Any]:
    """One calibration run (`tune_child.decode`) in a process of its own, forked from one that
    imported torch once; uncapped; stopped past `timeout_s` (it scores 0 tokens/s on every prompt)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    start = time.perf_counter()
    with context.Pool(1, maxtasksperchild=1) as pool:  # leaving the block terminates a run still going
        try:
            result = pool.apply_async(decode_here, (model_dir, prompts, new_tokens, predictor, options)).get(timeout_s)
        except multiprocessing.TimeoutError:
            return _scores_zero(prompts, timed_out=True)
    return {**result, "seconds": time.perf_counter() - start}


def decode_capped(model_dir: str, prompts: list[str], new_tokens: int, predictor: str | None,
                  options: RuntimeOptions, timeout_s: float = RUN_TIMEOUT_S) -> dict[str, Any]:
    """One calibration run in a new process in a memory cgroup capped at `options.memory`, the page
    cache dropped first (pages an earlier run left would serve this one uncharged); a run the kernel
    kills, or one still going after `timeout_s`, scores 0 tokens/s on every prompt. The kernels numba's
    cache lacks are compiled first, outside the cap (`compile_ahead`)."""
    compile_ahead()
    with tempfile.TemporaryDirectory(prefix="prescient-tune-") as tmp:
        spec, out = Path(tmp, "spec.pickle"), Path(tmp, "out.json")
        spec.write_bytes(pickle.dumps((model_dir, prompts, new_tokens, predictor, options)))
        drop_page_cache()
        run = run_capped([sys.executable, "-m", "offload_runtime.planning.tune_child", str(spec), str(out)],
                         options.memory, timeout_s)
        if run.killed or run.timed_out:
            return _scores_zero(prompts, killed=run.killed, timed_out=run.timed_out)
        if not out.is_file():
            raise TuneError(f"a calibration decode failed (exit {run.returncode}): {run.stderr_tail.strip()[-500:]}")
        result = json.loads(out.read_text())
    if "refused" in result:
        raise CapacityError(result["refused"])
    return {**result, "seconds": run.seconds}


def _scores_zero(prompts: list[str], killed: bool = False, timed_out: bool = False) -> dict[str, Any]:
    return {"tokens_per_s": [0.0] * len(prompts), "stats": {}, "memory_plan": None, "killed": killed,
            "timed_out": timed_out}


def starting_settings(predictor: str | Path | None) -> dict[str, Any]:
    """The built-in defaults, where tuning starts."""
    return {"transfer_workers": 1, "read_depth": 1, "policy": best_policy(predictor), "next_token_min_chance": None,
            "lookahead_layers": 0, "expert_pipeline": True, "map_experts": None, "use_predictor": True}


def candidate_changes(depth: int, forecasts: bool, mapped: bool = True,
                      predictor: bool = False) -> list[tuple[str, dict[str, Any]]]:
    """Each mechanism's change to try on top of the best so far, in order (`mapped`: mapped experts
    too, last, where the runs are capped; `predictor`: the runtime without it, before them: issue 50
    measured it faster than the predictor on prompts LRU decodes fast)."""
    changes = [("parallel reads", {"read_depth": depth}), ("transfer workers", {"transfer_workers": TRIED_WORKERS})] \
        if depth != 1 else []
    if forecasts:
        changes += [("policy lru", {"policy": "lru"}), ("cross-token prefetch", {"next_token_min_chance": 0.5})]
    changes += [("in-token lookahead", {"lookahead_layers": 1}), ("serial layers", {"expert_pipeline": False})]
    if predictor:
        changes.append(("no predictor", {"use_predictor": False, "policy": "lru", "next_token_min_chance": None}))
    return changes + ([("mapped experts", {"map_experts": True})] if mapped else [])  # last: then slots do not matter


def tune(model_dir: str | Path, predictor: str | Path | None = None, memories: list[int] | None = None,
         new_tokens: int = 48, repeats: int = 2, prompts: list[str] | None = None,
         on_size: Callable[[dict[str, Any]], None] | None = None, decode: Decode | None = None) -> dict[str, Any]:
    """The tuning record: the read curve, every run, and per size the best settings (see the module
    doc); `on_size(record)` after each size, so that a stopped tuning keeps the sizes it finished;
    `decode` runs one configuration, capped (None: a fresh process, in a cgroup where there is one)."""
    capped = decode is not None or cgroup_kind() != "none"
    if decode is None:
        decode = decode_capped if capped else decode_in_child
    if not capped:
        log.info("no writable memory cgroup here: tune runs uncapped and leaves mapped experts to --memory's rule")
    directory = ModelDirectory.of(model_dir)
    curve = measure_random_reads(*model_read_file(directory), repeats=2)
    forecasts = predictor is not None and best_policy(predictor) == "learned-belady"
    sizes = memories or [int(share * whole_model_memory(directory)) for share in DEFAULT_SHARES]
    prompts = prompts or calibration_prompts()
    changes = candidate_changes(curve.depth, forecasts, mapped=capped, predictor=predictor is not None)
    record: dict[str, Any] = {
        "model": str(directory), "predictor": predictor and str(predictor), "machine": machine_key(),
        "capped": capped,
        "new_tokens": new_tokens, "repeats": repeats, "prompts": prompts,
        "read_curve": {"expert_bytes": curve.expert_bytes, "depths": list(curve.depths),
                       "bytes_per_s": list(curve.bytes_per_s), "depth": curve.depth},
        "best": [], "runs": [], "refused": []}
    bar = tqdm(total=len(sizes) * (1 + len(changes)) * repeats * 2, desc="tune", unit="run", disable=None)

    def run(memory: int, settings: dict[str, Any]) -> list[float]:
        finished = [r["seconds"] for r in record["runs"] if r["memory"] == memory and r.get("seconds")]
        limit = min(RUN_TIMEOUT_S, max(MIN_LIMIT_S, SLOWER_LIMIT * min(finished))) if finished else RUN_TIMEOUT_S
        result = decode(str(directory), prompts, new_tokens, predictor and str(predictor),
                        RuntimeOptions(memory=memory, **settings), timeout_s=limit)
        record["runs"].append({"memory": memory, "settings": settings, "tokens_per_s": result["tokens_per_s"],
                               "decode_major_faults_per_token": result.get("decode_major_faults_per_token"),
                               "decode_read_bytes_per_token": result.get("decode_read_bytes_per_token"),
                               "stats": result["stats"], "memory_plan": result["memory_plan"],
                               "killed": result.get("killed", False), "timed_out": result.get("timed_out", False),
                               "seconds": result.get("seconds")})
        bar.update()
        return result["tokens_per_s"]

    for memory in sizes:
        try:
            # uncapped, nothing may be mapped (its page cache would hold every expert), and the rule stays the default
            start = {**starting_settings(predictor), **({} if capped else {"map_experts": False})}
            best = _best_at(memory, start, changes, repeats, run)
            if not capped:
                best["settings"]["map_experts"] = None
        except CapacityError as exc:
            record["refused"].append({"memory": memory, "why": str(exc)})
            continue
        record["best"].append({"memory": memory, **best})
        if on_size is not None:
            on_size(record)
    bar.close()
    return record


def _best_at(memory: int, start: dict[str, Any], changes: list[tuple[str, dict[str, Any]]], repeats: int,
             decode: Callable[[int, dict[str, Any]], list[float]]) -> dict[str, Any]:
    """Coordinate search at one size: each change against the best so far, interleaved; a run's
    score is its tokens/s per prompt, its summary their mean; CapacityError where no run decoded."""
    best, best_runs, kept = start, [], []
    for name, change in changes:
        trial = {**best, **change}
        if trial == best:
            continue
        trial_runs, beside = [], []
        for _ in range(repeats):  # A B A B: the best so far and the trial, in turn
            beside.append(decode(memory, best))
            trial_runs.append(decode(memory, trial))
        best_runs += beside
        if _wins_beyond_the_spread(trial_runs, beside):
            best, best_runs = trial, trial_runs
            kept.append(name)
    if not best_runs:  # nothing to try: measure the start once for the record
        best_runs = [decode(memory, best) for _ in range(repeats)]
    means = [statistics.fmean(run) for run in best_runs]
    if max(means) == 0:  # every run killed or stopped: nothing measured, nothing to keep
        raise CapacityError("every calibration decode was killed for want of memory under the cap or stopped past "
                            "its time limit")
    return {"settings": {k: best[k] for k in TUNED_SETTINGS}, "kept": kept,
            "tokens_per_s": statistics.median(means), "spread": [min(means), max(means)]}


def _wins_beyond_the_spread(trial_runs: list[list[float]], beside: list[list[float]]) -> bool:
    """The paired statistic: per prompt the trial's median over the best's median beside it, their
    geometric mean over the prompts (a 2x gain on one prompt and a 2x loss on another cancel) must
    exceed the best's own spread, its slowest run against its fastest per prompt, likewise averaged:
    a gain within the spread is not a gain. Runs that scored 0 (killed, stopped) count as 0."""
    prompts = range(len(beside[0]))
    ratios = [_ratio(statistics.median(run[p] for run in trial_runs), statistics.median(run[p] for run in beside))
              for p in prompts]
    spread = [_ratio(max(run[p] for run in beside), min(run[p] for run in beside)) for p in prompts]
    return statistics.geometric_mean(ratios) > statistics.geometric_mean(spread) + 1e-9  # a tie is no gain


def _ratio(mine: float, theirs: float) -> float:
    """mine / theirs, kept within [1e-3, 1e3] where either is 0."""
    return min(max((mine + 1e-9) / (theirs + 1e-9), 1e-3), 1e3)


def calibration_prompts(tokens: int = 48) -> list[str]:
    """Real prompts, held out from the predictor's training: the starts of the first two long rows
    of the built-in code corpus's validation split and of the first of its docs corpus."""
    from training.corpora import load_corpus

    def starts(corpus: str, count: int) -> list[str]:
        rows = (row for row in load_corpus(corpus, "validation")["text"] if len(row) > 8 * tokens)
        return [next(rows)[: 4 * tokens] for _ in range(count)]

    return starts("stdlib-code", 2) + starts("stdlib-docs", 1)
