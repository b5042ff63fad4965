"""`prescient bench`: decode speed and memory of the offloading runtime per budget, predictor and
cache policy, beside the all-resident model and accelerate's disk offload.

    prescient bench --model DIR --json OUT.json --plot OUT.png [--budgets 0.25,0.5,1.0] \
        [--predictors none,freq,corr,oracle,sida=PATH] [--policies lru,lfu,fifo,mrs] \
        [--grid default|full | --runs PRED:POLICY@BUDGET,...] [--train-trace DIR] \
        [--new-tokens N] [--prompts K] [--prompt-tokens T] [--sample SEED] [--transfer-workers N] [--in-process]

How each number is measured is in `METHOD` (also written into the JSON as `method`).

JSON: settings, machine, model {dir, expert_bytes, total_expert_bytes, ...}, prompts,
method, baselines {all_resident, accelerate_disk}, runs [records], hash_thread_cost, ratios
{RUN at the headline budget: tokens_per_s, vs_none_lru, vs_all_resident, vs_accelerate_disk},
complete. A record: label, kind, [predictor, policy, budget], tokens_per_s, peak_rss_mb,
hit_rate, stall_seconds, bytes_moved, late_tables, exact, decode_tokens, decode_seconds,
prefill_seconds, load_seconds, rss_after_load_mb, load_peak_rss_mb, peak_rss_scope, stats
(the runtime's, over the decode windows), options (the run's `RuntimeOptions`, whole) and error
where a run failed. The all_resident baseline also holds token_ids: the reference every run is
compared with. The other modules of this package are named in its `__init__`.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from cache.timing import LinkTiming
from experiments.bench_runtime.grid import BASELINES, BenchError, RunSpec, check_grid
from experiments.bench_runtime.load import Job
from experiments.bench_runtime.measure import Executor
from experiments.bench_runtime.records import not_exact, ratios, record_of, record_run, require_exact
from experiments.machine import machine_info
from experiments.timing_calibration import load_timing
from offload_runtime.engine.options import RuntimeOptions
from prescient.atomic import write_json_atomic
from prescient.fingerprint import ModelFingerprint, fingerprint_model_dir
from prescient.model_dir import ModelDirectory

log = logging.getLogger(__name__)

METHOD = {
    "prompts": "the first K+1 texts of the corpus split with at least T tokens, cut to T tokens; the first is a "
               "warm-up generated untimed before the K timed ones in every run (the cache carries over from prompt "
               "to prompt, as when serving); batch size 1, exactly N new tokens",
    "decoding": "greedy; or, with settings.sample_seed, sampled under the model's generation settings (do_sample) "
                "from a torch seed made of sample_seed and the prompt's ids, so every run draws the same numbers "
                "for a prompt and exact runs generate the same tokens",
    "tokens_per_s": "a streamer notes the time of each new token; a prompt's decode time runs from its first token "
                    "(end of prefill) to its last, so prefill is excluded; tokens/s = sum(N-1) / sum(decode time) "
                    "over the timed prompts; runtime stats cover the same decode windows",
    "exact": "the run's generated ids equal the all-resident model's (a prefix of them for accelerate_disk)",
    "isolation": "each run in a fresh process forked from a forkserver that imported torch and transformers once "
                 "(settings.isolated_processes false: every run in one process, for quick checks)",
    "peak_rss_mb": "peak resident set of the run's process from after the model is loaded through warm-up and "
                   "timed generation (Linux VmHWM, reset through /proc/self/clear_refs after loading, garbage "
                   "collection and malloc_trim; where that is impossible, ru_maxrss over the process lifetime: "
                   "see peak_rss_scope); it counts the file pages the process maps (a from_pretrained model keeps its "
                   "safetensors mapped) and only slots that were filled; load_peak_rss_mb is the peak before the "
                   "reset (load_offloaded loads the whole checkpoint once, then drops the experts)",
    "offloaded": "load_offloaded(store, drop_page_cache): experts read from the checkpoint with pread, the page "
                 "cache dropped after each read",
    "all_resident": "the plain transformers model with every weight in memory; its ids are the reference",
    "accelerate_disk": "from_pretrained(device_map=..., offload_folder=...) with every routed experts module mapped to "
                       "'disk' and all else to 'cpu': transformers writes those modules' tensors to the offload "
                       "folder, accelerate's AlignDevicesHook reads a module's whole tensors (all its experts) before "
                       "each of its forwards and frees them after (CPU execution; accelerate has no per-expert "
                       "loading). With drop_page_cache a forward hook drops the offload files' pages after each "
                       "experts forward, as our store does. Its cost per token is flat, so it runs the first timed "
                       "prompt only, with baseline_tokens new tokens and no warm-up",
    "oracle": "the all-resident run first generates every prompt with router hooks on, recording the router's "
              "choices of each forward; they are written as a trace that OraclePredictor replays (it knows every "
              "prefix of the generated sequences: exact for exact runs)",
    "predictors": "freq / token / corr: fit on train_trace (corr gives its token-level predict/step guess); "
                  "NAME=PATH: a predictor artifact such as a SiDA hash function",
    "hash_thread_cost": "decode tokens/s at budget 1.0 (lru) with the hash-building thread running the predictor but "
                        "its tables ignored (scores computed, then published as zeros, which the runtime turns into no "
                        "prefetches) against no predictor; both runs first generate the timed prompts once untimed, "
                        "so every expert they use is resident and the timed pass loads nothing (see bytes_moved)",
}
HEADLINE_BUDGET = 0.5
SHARED_OPTIONS = RuntimeOptions(drop_page_cache=True)  # what every run shares unless the caller says otherwise


def prompt_ids(tokenizer, texts: list[str], count: int, tokens: int) -> list[list[int]]:
    """The first `count` texts with at least `tokens` tokens, cut to `tokens` tokens."""
    out = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        out += [ids[:tokens]] if len(ids) >= tokens else []
        if len(out) == count:
            return out
    raise BenchError(f"{len(out)} of the {len(texts)} prompt texts have {tokens} tokens; {count} are needed")


def bench_runtime(
    model_dir: str | Path,
    texts: list[str],
    *,
    predictors: dict[str, str | None],
    runs: list[RunSpec],
    timed_prompts: int = 2,
    prompt_tokens: int = 16,
    new_tokens: int = 12,
    warmup_tokens: int = 4,
    train_trace: str | Path | None = None,
    baselines: tuple[str, ...] = BASELINES,
    baseline_tokens: int = 4,
    sample_seed: int | None = None,
    options: RuntimeOptions = SHARED_OPTIONS,
    hash_cost_predictor: str | None = None,
    threads: int | None = None,
    isolate: bool = True,
    work_dir: str | Path | None = None,
    simulate: bool = False,
    link_timing: str | Path | None = None,
    next_token_min_chance: float = 0.5,
    json_path: str | Path | None = None,
    plot_path: str | Path | None = None,
    fail_if_not_exact: bool = True,
) -> dict[str, Any]:
    """Measure the baselines, every run of `runs` and the hash thread's cost; returns the JSON
    of the module doc, also written to `json_path` after every run (`complete` turns true at
    the end, unless a run failed or was not exact: then a `NotExactError` names them, unless
    not `fail_if_not_exact`). Prompts: the first `timed_prompts` + 1 of `texts` with `prompt_tokens` tokens
    (the first is the warm-up). `predictors`: name -> artifact path, or None for a built-in
    (freq, token, corr: fit on `train_trace`; oracle; none). `sample_seed`: sampled decoding
    (see METHOD["decoding"]) instead of greedy. `options`: the runtime options every run shares
    (store, page cache, transfer workers, ...); each run sets its policy, budget and prefetch
    modes on a copy, recorded with the run. `simulate`: the time-true simulator's prediction
    beside each run (`experiments.bench_runtime.simulated`; needs the all_resident baseline).
    A run's prefetch modes: `hide` prefetches only what the link of `link_timing` (a bench or
    hardware-profile JSON, `experiments.timing_calibration.load_timing`) can hide behind compute,
    `next` reaches into the next token for experts forecast at least `next_token_min_chance` likely."""
    predictors = _check(model_dir, runs, predictors, hash_cost_predictor, train_trace, baselines, simulate, link_timing)
    if min(new_tokens, baseline_tokens) < 2 or timed_prompts < 1:
        raise BenchError("decode speed needs at least 2 new tokens and 1 timed prompt")
    threads = threads or torch.get_num_threads()
    directory = ModelDirectory.of(model_dir)
    tokenizer = directory.tokenizer()
    ids = prompt_ids(tokenizer, texts, timed_prompts + 1, prompt_tokens)
    settings = _settings(runs, predictors, options, new_tokens=new_tokens, timed_prompts=timed_prompts,
                         prompt_tokens=prompt_tokens, warmup_tokens=warmup_tokens, baseline_tokens=baseline_tokens,
                         sample_seed=sample_seed, train_trace=train_trace and str(train_trace),
                         isolated_processes=isolate, next_token_min_chance=next_token_min_chance)
    result: dict[str, Any] = {
        "settings": settings, "machine": machine_info(threads), "model": {"dir": str(model_dir)},
        "prompts": {"warmup": ids[0], "timed": ids[1:]}, "method": METHOD,
        "baselines": {}, "runs": [], "hash_thread_cost": None, "ratios": {}, "complete": False,
    }
    save = partial(write_json_atomic, json_path, result) if json_path is not None else lambda: None
    total = 1 + ("accelerate_disk" in baselines) + len(runs) + 2 * (hash_cost_predictor is not None)
    model_type = directory.config.model_type
    execute = Executor(isolate, (f"transformers.models.{model_type}.modeling_{model_type}",))
    with _work_dir(work_dir) as work, tqdm(total=total, desc="bench", unit="run") as bar:
        work = Path(work)
        work.mkdir(parents=True, exist_ok=True)
        oracle_trace = work / "oracle-trace"
        base = Job("offloaded", str(model_dir), ids[1:], new_tokens, warmup=ids[:1], warmup_tokens=warmup_tokens,
                   pad_token_id=tokenizer.pad_token_id, threads=threads, options=options, work_dir=str(work),
                   sample_seed=sample_seed)
        bar.set_postfix_str("all_resident")
        trace_out = oracle_trace if "oracle" in predictors or simulate else None
        reference, fingerprint = _reference(execute, base, directory, trace_out, "all_resident" in baselines, result)
        link = _link(result, link_timing, model_dir, fingerprint) if any("hide" in r.modes for r in runs) else None
        bar.update()
        paths = {"oracle": str(oracle_trace), **_artifacts(predictors, fingerprint, train_trace, work)}
        if "accelerate_disk" in baselines:
            bar.set_postfix_str("accelerate_disk")
            job = replace(base, kind="accelerate_disk", prompts=ids[1:2], warmup=[], new_tokens=baseline_tokens)
            result["baselines"]["accelerate_disk"] = record_run(execute, job, None, reference)
            bar.update()
        save()
        for spec in runs:
            bar.set_postfix_str(spec.label)
            job = _run_job(base, spec, paths, link, next_token_min_chance)
            result["runs"].append(record := record_run(execute, job, spec, reference))
            result["model"].update(record.pop("model_info", None) or {})
            bar.update()
            save()
        if hash_cost_predictor is not None:
            result["hash_thread_cost"] = _hash_thread_cost(execute, base, hash_cost_predictor,
                                                           paths.get(hash_cost_predictor), reference, bar)
        if simulate:
            from experiments.bench_runtime.simulated import simulate_bench

            bar.set_postfix_str("simulating")
            simulate_bench(result, oracle_trace, paths, next_token_min_chance)
    _finish(result, save, json_path, plot_path, fail_if_not_exact)
    return result


def _finish(result: dict[str, Any], save: Callable[[], Any], json_path: str | Path | None,
            plot_path: str | Path | None, fail_if_not_exact: bool) -> None:
    """The ratios and `complete` (never with a run that is not exact), the last save, the plot,
    and then, with `fail_if_not_exact`, a `NotExactError` naming the runs that were not exact."""
    result["ratios"] = ratios(result["runs"], result["baselines"], HEADLINE_BUDGET)
    bad = not_exact([*result["runs"], *result["baselines"].values()])
    result["complete"] = not bad  # kept for inspection, never complete with a run that is not exact
    save()
    if plot_path is not None:
        from experiments.bench_runtime.plot import plot_bench  # matplotlib only when plotting

        plot_bench(result, plot_path)
    if fail_if_not_exact:
        require_exact(bad, json_path)


def _work_dir(work_dir: str | Path | None) -> AbstractContextManager[str]:
    """`work_dir`, or a temporary folder removed at the end."""
    return tempfile.TemporaryDirectory(prefix="prescient-bench-") if work_dir is None else nullcontext(str(work_dir))


def _settings(runs: list[RunSpec], predictors: dict[str, str | None], options: RuntimeOptions,
              **given: Any) -> dict[str, Any]:
    """The JSON's settings: the grid, the options every run shares, and the `given` ones."""
    return {"budgets": sorted({r.budget for r in runs}), "policies": sorted({r.policy for r in runs}),
            "predictors": {k: v and str(v) for k, v in predictors.items()}, **given,
            "transfer_workers": options.transfer_workers, "store": options.store,
            "drop_page_cache": options.drop_page_cache, "dtype": options.dtype, "slot_format": options.slot_format,
            "headline_budget": HEADLINE_BUDGET, "link_timing": None}


def _reference(execute: Executor, base: Job, model_dir: ModelDirectory, trace_out: Path | None, keep: bool,
               result: dict[str, Any]) -> tuple[list[list[int]], ModelFingerprint]:
    """The all-resident run: the token ids every run is compared with, and the model's
    fingerprint; recorded as the all_resident baseline if `keep`. With `trace_out` it also
    writes the router choices there (the oracle's trace). Packed slots compute with another
    kernel than the model loaded whole: their all-resident run is the runtime with a slot for
    every expert (loaded as first used), so exactness is checked within the placement."""
    if base.options.slot_format == "packed":
        if trace_out is not None:
            raise BenchError("the oracle and --simulate read the all-resident model's trace, which packed slots do "
                             "not write; bench them with --slot-format expanded")
        # mixed precision: the coarse model's (a mixed run's choices vary with its budget)
        ref = execute(replace(base, options=replace(base.options, budget=1.0, policy="lru", fine_model=None)))
        ref.pop("model_info", None)
        ref["fingerprint"] = fingerprint_model_dir(model_dir).to_dict()
    else:
        ref = execute(replace(base, kind="all_resident", trace_out=str(trace_out) if trace_out is not None else None))
    reference = ref["token_ids"]
    fingerprint = ModelFingerprint.from_dict(ref.pop("fingerprint"))
    result["model"]["fingerprint"] = fingerprint.to_dict()  # a timing calibration checks it
    if keep:
        result["baselines"]["all_resident"] = {**record_of(None, "all_resident", dict(ref), reference),
                                               "token_ids": reference}
    return reference, fingerprint


def _link(result: dict[str, Any], link_timing: str | Path, model_dir: str | Path, fingerprint) -> LinkTiming:
    """The link +hide runs weigh copies against, calibrated for this model and recorded in the settings."""
    calibration = load_timing(link_timing, model_config=model_dir, fingerprint=fingerprint)
    result["settings"]["link_timing"] = calibration.to_dict()
    return calibration.timing


def _run_job(base: Job, spec: RunSpec, paths: dict[str, str], link: LinkTiming | None,
             next_token_min_chance: float) -> Job:
    """The job of run `spec`: the shared options with its policy, budget, prefetch and scheduler modes."""
    options = replace(base.options, budget=spec.budget, policy=spec.policy,
                      link_timing=link if "hide" in spec.modes else None,
                      next_token_min_chance=next_token_min_chance if "next" in spec.modes else None,
                      expert_pipeline="serial" not in spec.modes, lookahead_layers=1 if "look" in spec.modes else 0,
                      lookahead_probe=base.options.lookahead_probe if "look" in spec.modes else None,
                      hybrid_schedule="hybrid" in spec.modes)
    return replace(base, options=options, predictor_path=paths.get(spec.predictor),
                   predictor=None if spec.predictor == "none" else spec.predictor)


def _check(model_dir: str | Path, runs: list[RunSpec], predictors: dict[str, str | None],
           hash_cost_predictor: str | None, train_trace: str | Path | None, baselines: tuple[str, ...],
           simulate: bool, link_timing: str | Path | None) -> dict[str, str | None]:
    """Refuse, before any work, what the bench cannot run; returns the predictors some run uses."""
    if hash_cost_predictor is not None and hash_cost_predictor not in predictors:
        raise BenchError(f"hash-cost predictor {hash_cost_predictor!r} is not among the predictors")
    used = {spec.predictor for spec in runs} | {hash_cost_predictor}
    predictors = {name: path for name, path in predictors.items() if name in used}
    check_grid(runs, predictors, train_trace)
    if simulate and "all_resident" not in baselines:
        raise BenchError("--simulate calibrates the simulator's compute time on the all_resident baseline: keep it")
    if simulate and not any(spec.predictor == "none" and spec.budget < 1 for spec in runs):
        raise BenchError("--simulate calibrates the simulator's link on a run without a predictor below budget 1.0 "
                         "(e.g. none:lru@0.5): add one")
    if any("hide" in spec.modes for spec in runs):
        if link_timing is None:
            raise BenchError("+hide runs weigh each copy against compute: pass --link-timing BENCH.json|PROFILE.json")
        load_timing(link_timing, model_config=model_dir)  # a bad file fails before any run; its model is checked later
    return predictors


def _artifacts(predictors: dict[str, str | None], fingerprint, train_trace: str | Path | None,
               work: Path) -> dict[str, str]:
    """Predictor name -> artifact: the given ones, checked against the model, and freq / token /
    corr fit on the train trace and saved in `work`."""
    from predictor.artifact import read_predictor_meta, save_predictor
    from predictor.registry import FITTED
    from prescient.traces import load_trace

    paths = {}
    fit = load_trace(train_trace) if any(p is None and n in FITTED for n, p in predictors.items()) else None
    if fit is not None:
        fingerprint.require_same(fit.fingerprint, f"train trace {train_trace}")
    for name, path in predictors.items():
        if path is not None:
            fingerprint.require_same(read_predictor_meta(path).fingerprint, f"predictor {path}")
            paths[name] = str(path)
        elif name in FITTED:
            paths[name] = str(save_predictor(FITTED[name](fit, trace_dir=str(train_trace)), work / name))
    return paths


def _hash_thread_cost(execute: Executor, base: Job, name: str, path: str | None, reference: list[list[int]],
                      bar: tqdm) -> dict[str, Any]:
    """Budget 1.0, every used expert made resident by an untimed pass over the timed prompts:
    the thread running `name` with its tables ignored, against no thread."""
    warm = replace(base, options=replace(base.options, budget=1.0, policy="lru"), warmup=base.prompts,
                   warmup_tokens=base.new_tokens)
    records = {}
    for key, job, spec in [
        ("with_thread_tables_ignored", replace(warm, predictor=name, predictor_path=path, ignore_tables=True),
         RunSpec(name, "lru", 1.0)),
        ("without_thread", warm, RunSpec("none", "lru", 1.0)),
    ]:
        bar.set_postfix_str(f"hash cost: {key}")
        records[key] = {**record_run(execute, job, spec, reference), "label": f"hash_thread_cost/{key}"}
        records[key].pop("model_info", None)
        bar.update()
    speeds = [records[k]["tokens_per_s"] for k in records]
    return {"predictor": name, "budget": 1.0, "policy": "lru", **records,
            "tokens_per_s_ratio": speeds[0] / speeds[1] if all(speeds) else None}
