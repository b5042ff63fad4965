"""`prescient bench-batch`: the batch schedules against each other and their baselines, Klotski's
planner against a sweep of group sizes, and the HRM check.

At each compared policy (N requests, micro-batch size μ, resident expert fraction r_w), the
same requests decode at the same budget (the slots r_w needs) under

  klotski      Klotski's multi-batch pipeline: the N/μ micro-batches form one group; hot
               experts from the correlation table (requested once the previous layer's gate
               chose), cold ones after the gate
  klotski-paper  the same with the hot experts requested at the layer's attention, as the paper
  cgopipe      MoE-Lightning's CGOPipe: every streamed expert paged in each step
  zigzag       FlexGen's zig-zag block schedule: a layer's streamed experts loaded once per
               block of micro-batches, a layer ahead
  sequential   (at `sequential_at`) the micro-batches one after another, experts on demand
  accelerate   transformers + accelerate's own offloading (`device_map="auto"`, a disk offload
               folder) at the same bytes of weights in memory, one batched `generate`
               (`experiments.bench_batch_accelerate`)

in interleaved repeats (A B C A B C ...), each run on a freshly loaded runtime (accelerate: in
the repeats, once, or not, as `accelerate` says); plus plain batched `generate` with every weight
resident, once. Beside each run, the HRM's prediction for its schedule (`hrm.estimate_schedule`)
of end-to-end and decode tokens/s. Each run reports end-to-end tokens/s
(every generated token over prefill + decode), decode tokens/s, and bytes moved per generated
token; the summary takes medians and spreads over the repeats.

Klotski's planner (`offload_runtime.planning.klotski`) picks the group size n from this
machine's measured times (attention, gate, expert compute, expert copy) and the trace's expert
shares; a sweep of n at one (μ, r_w) measures how far its choice lands below the best n.

The HRM check: over a grid of policies, the CGOPipe loop's measured decode throughput against the
HRM's prediction (Spearman rank correlation) and the HRM planner's choice against the best; over
the compared runs, each schedule's prediction over its measurement.

Every decode is checked token for token against each request generated alone by the plain model.
The JSON is rewritten after every run, so an interrupted benchmark keeps what it measured.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from experiments.bench_batch_accelerate import measure_accelerate
from experiments.bench_batch_resident import measure_resident, reference_outputs
from experiments.bench_batch_shared import ACCELERATE_RUNS, hot_ranking, median_spread
from experiments.machine import release_freed_memory
from offload_runtime.engine.options import RuntimeOptions
from prescient.atomic import write_json_atomic
from prescient.errors import PrescientError

log = logging.getLogger(__name__)


class BenchBatchError(PrescientError):
    """A batch benchmark was asked for with a malformed policy."""


@dataclass(frozen=True)
class BatchPolicy:
    requests: int  # N
    micro_batch: int  # μ
    resident: float  # r_w

    @property
    def label(self) -> str:
        return f"N={self.requests} μ={self.micro_batch} r_w={self.resident:g}"


BATCH_OPTIONS = RuntimeOptions(policy="fifo", drop_page_cache=True)  # the schedule chooses what stays resident
MODES = ("klotski", "klotski-paper", "cgopipe", "zigzag")


def parse_grid(text: str) -> list[BatchPolicy]:
    """"N:μ:r_w,..." → policies."""
    out = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            n, mu, rw = item.split(":")
            out.append(BatchPolicy(int(n), int(mu), float(rw)))
        except ValueError:
            raise BenchBatchError(f"cannot read policy {item!r}; write N:MICRO_BATCH:RESIDENT, e.g. 16:4:0.5") from None
    return out


def request_prompts(tokenizer, count: int, shortest: int, longest: int, dataset: str, split: str) -> list[list[int]]:
    """`count` prompts from the corpus, their lengths spread evenly over [shortest, longest]."""
    from training.corpora import load_corpus

    lengths = [shortest + (longest - shortest) * i // max(1, count - 1) for i in range(count)]
    prompts: list[list[int]] = []
    for text in load_corpus(dataset, split)["text"]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= lengths[len(prompts)]:
            prompts.append(ids[:lengths[len(prompts)]])
            if len(prompts) == count:
                return prompts
    raise BenchBatchError(f"{dataset}:{split} has only {len(prompts)} texts of the lengths needed for {count} requests "
                          "(the largest policy's N, or a sweep's group size n times its micro-batch); ask for fewer")


def store_read_bandwidth(model_dir: str, options: RuntimeOptions) -> float:
    """Bytes/s of the expert store of `options` reading a layer's experts into slots, the way a
    decode step streams them (a test on one sequential file overstates it here: expert reads are
    split by tensor and jump around the file): the median over every layer but the first."""
    import statistics

    from offload_runtime.engine.loader import load_offloaded

    model = load_offloaded(model_dir, None, dataclasses.replace(options, budget=1 / 4))
    runtime = model.runtime
    rates = []
    with runtime:
        expert_bytes = runtime.pool.nbytes / runtime.pool.num_slots
        n_layers = len(runtime.layers)
        for layer in range(min(1, n_layers - 1), n_layers):
            keys = [(layer, e) for e in range(min(runtime.n_experts, runtime.pool.num_slots))]
            start = time.perf_counter()
            for slot, key in enumerate(keys):
                runtime.store.read(key, runtime.pool.view(slot))
            rates.append(len(keys) * expert_bytes / (time.perf_counter() - start))
    return statistics.median(rates)


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    import numpy as np

    def ranks(x: list[float]) -> np.ndarray:
        x = np.asarray(x, dtype=float)
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x))
        for value in np.unique(x):  # ties share their mean rank
            r[x == value] = r[x == value].mean()
        return r

    ra, rb = ranks(a), ranks(b)
    return float(np.corrcoef(ra, rb)[0, 1])


def correlation_table(trace: str | None, correlation: str | None, fingerprint):
    """Klotski's table: a saved `klotski-correlation` artifact, else built from `trace`, else
    None (the pipe starts an empty one and learns online)."""
    from predictor.correlation import CorrelationTable
    from prescient.traces import load_trace

    if correlation is not None:
        table = _load_table(correlation)
        fingerprint.require_same(table.meta.fingerprint, f"correlation table {correlation}")
        return table
    if trace is None:
        return None
    loaded = load_trace(trace)
    fingerprint.require_same(loaded.fingerprint, f"trace {trace}")
    return CorrelationTable.from_trace(loaded, trace_dir=trace)


def _load_table(correlation: str):
    from predictor.artifact import load_predictor
    from predictor.correlation import CorrelationTable

    table = load_predictor(correlation)
    if not isinstance(table, CorrelationTable):
        raise BenchBatchError(f"{correlation} holds a {table.kind!r} predictor, not a klotski-correlation table")
    return table


def _check_table_shape(correlation: str, spec) -> None:
    """Refuse a correlation table of another model's layout (experts, top-k, vocabulary) from the
    config alone; the full fingerprint (weights included) is checked once the model is loaded."""
    fp = _load_table(correlation).meta.fingerprint
    mine, theirs = (spec.num_experts, spec.top_k, spec.vocab_size), (fp.n_experts, fp.top_k, fp.vocab_size)
    if mine != theirs:
        raise BenchBatchError(f"correlation table {correlation} is of another model: (experts, top-k, vocab) "
                              f"{theirs}, this model's {mine}")


def make_decoder(mode: str, model, policy: BatchPolicy, hot, table, hot_count: int | None):
    from offload_runtime.cgopipe.klotski import KlotskiPipe
    from offload_runtime.cgopipe.pipe import CGOPipe
    from offload_runtime.cgopipe.zigzag import ZigZagDecoder

    if mode.startswith("klotski"):
        return KlotskiPipe(model, policy.resident, table=table, hot_count=hot_count, hot=hot,
                           early_hot=mode == "klotski")
    if mode == "zigzag":
        return ZigZagDecoder(model, policy.resident, hot=hot)
    return CGOPipe(model, policy.resident, hot=hot, overlap=mode == "cgopipe")


def measure_schedule(model_dir: str, prompts: list[list[int]], gen_len: int, policy: BatchPolicy, mode: str,
                     reference: list[list[int]], hot, options: RuntimeOptions, table=None,
                     hot_count: int | None = None) -> dict[str, Any]:
    """One run of `mode` at `policy` on a fresh runtime of `options` at the budget r_w needs."""
    from offload_runtime.cgopipe.zigzag import budget_fraction
    from offload_runtime.engine.loader import load_offloaded

    n_layers, n_experts = len(hot), len(hot[0])
    budget = budget_fraction(policy.resident, n_layers, n_experts)
    options = dataclasses.replace(options, budget=budget)
    model = load_offloaded(model_dir, None, options)
    requests = prompts[:policy.requests]
    n_micro = -(-policy.requests // policy.micro_batch)
    with model.runtime as runtime, make_decoder(mode, model, policy, hot, table, hot_count) as pipe:
        out = pipe.generate(requests, gen_len, micro_batch_size=policy.micro_batch, n_micro=n_micro,
                            pad_token_id=model.config.pad_token_id or 0)
        stats = runtime.stats()
    run = {
        **asdict(policy), "label": policy.label, "mode": mode, "budget_fraction": budget,
        "tokens_per_s": pipe.stats.tokens_per_s, "decode_tokens_per_s": pipe.stats.decode_tokens_per_s,
        "decode_seconds": round(pipe.stats.decode_seconds, 4), "prefill_seconds": round(pipe.stats.prefill_seconds, 4),
        "generated_tokens": pipe.stats.generated_tokens, "exact": out == reference[:policy.requests],
        "bytes_moved": stats.bytes_moved, "bytes_per_token": stats.bytes_moved / pipe.stats.generated_tokens,
        "decode_bytes_per_token": pipe.stats.decode_bytes / max(pipe.stats.decode_tokens, 1),
        "loads": stats.loads, "demand_loads": stats.demand_loads, "prefetch_hits": stats.prefetch_hits,
        "wasted_prefetches": stats.wasted_prefetches, "stall_seconds": stats.stall_seconds, "slots": stats.slots,
        "options": options.to_json(),
    }
    if mode.startswith("klotski"):
        run["hot_count"] = pipe.hot_count
        run["activated_share"] = sum(pipe.activated_share) / max(len(pipe.activated_share), 1)
    del model, pipe, runtime
    release_freed_memory()  # before the next run loads its own slot pool
    return run


def predicted(spec, hardware, prompt_len: int, gen_len: int, policy: BatchPolicy, mode: str = "cgopipe",
              resident: float | None = None) -> dict[str, float]:
    """The HRM's end-to-end and decode tokens/s for `mode` at `policy` (`hrm.estimate_schedule`);
    accelerate decodes the whole batch as one micro-batch with `resident`, the share of expert
    bytes its device map kept in memory."""
    from offload_runtime.planning.hrm import Policy, Workload, estimate_schedule

    place = "cpu" if hardware.gpu is None else "gpu"
    n, mu, r_w = policy.requests, policy.micro_batch, policy.resident
    if mode == "accelerate":
        mu, r_w = n, resident if resident is not None else r_w
    est = estimate_schedule(spec, hardware, Workload(prompt_len, gen_len),
                            Policy(n_requests=n, micro_batch=mu, attention_on="cpu", ffn_on=place, r_w=r_w), mode)
    return {"predicted_tokens_per_s": est.tokens_per_s, "predicted_decode_tokens_per_s": est.decode_tokens_per_s}


def bench_batch(model_dir: str, json_path: str, plot_path: str | None, compared: list[BatchPolicy],
                grid: list[BatchPolicy], sequential_at: list[BatchPolicy], gen_len: int, shortest: int, longest: int,
                hardware: str | None, trace: str | None, repeats: int = 3, sweep: tuple[int, float, list[int]] | None = None,
                correlation: str | None = None, hot_count: int | None = None,
                options: RuntimeOptions = BATCH_OPTIONS, dataset: str = "stdlib-code", split: str = "validation",
                threads: int = 1, accelerate: str = "repeats") -> dict[str, Any]:
    """`compared`: the policies every schedule runs at (the first is the main one, where the
    all-resident run is measured); `sweep`: (μ, r_w, group sizes n) of Klotski's planner check
    (None: no sweep); `options`: the runtime's (its store and page cache), each run at the
    budget its r_w needs; `accelerate`: the accelerate baseline in every repeat, in the first
    only, or not at all (`ACCELERATE_RUNS`)."""
    import torch

    from experiments.machine import machine_info
    from offload_runtime.planning.hrm import ModelSpec
    from prescient.fingerprint import fingerprint_model
    from prescient.loading import load_model, load_tokenizer

    spec = ModelSpec.from_config(model_dir)
    _refuse_early(spec, accelerate, correlation, hot_count, compared, sweep)
    torch.set_num_threads(threads)
    sweep_policies = [BatchPolicy(n * sweep[0], sweep[0], sweep[1]) for n in sweep[2]] if sweep else []
    count = max(p.requests for p in [*compared, *grid, *sequential_at, *sweep_policies])
    prompts = request_prompts(load_tokenizer(model_dir), count, shortest, longest, dataset, split)
    profile = _hardware_profile(model_dir, hardware, options)
    # the plain model serves the reference outputs, the all-resident run, the measured times and
    # the fingerprint; it is loaded after the disk measurements and dropped before the offloaded
    # runs, since its memory-mapped checkpoint would keep the page cache from being dropped
    plain, layers = load_model(model_dir, dtype=torch.float32)
    fingerprint = fingerprint_model(plain, layers)
    hot = hot_ranking(fingerprint, trace)
    table = correlation_table(trace, correlation, fingerprint)
    mean_prompt = round(sum(len(p) for p in prompts) / len(prompts))
    main = compared[0]
    result: dict[str, Any] = {
        "settings": {"model": model_dir, "gen_len": gen_len, "prompt_tokens": [shortest, longest],
                     "dataset": f"{dataset}:{split}", "store": options.store,
                     "drop_page_cache": options.drop_page_cache, "repeats": repeats,
                     "hot_ranking": trace or "expert id", "correlation_table": correlation or trace or "empty, online",
                     **_policy_settings(compared, sequential_at, grid, accelerate)},
        "machine": machine_info(threads), "hardware_profile": profile.to_dict(), "runs": [],
    }

    def save() -> None:
        write_json_atomic(Path(json_path), result)

    log.info("reference: each of %d requests alone with the plain model", count)
    reference = reference_outputs(plain, prompts, gen_len)
    result["resident"] = {**asdict(main), **measure_resident(plain, prompts[:main.requests], gen_len,
                                                             reference[:main.requests])}
    if sweep:
        result["klotski_times"] = _klotski_times(plain, layers, spec, profile, sweep[0], mean_prompt + gen_len // 2)
    del plain, layers
    save()

    def record(run: dict[str, Any], what: str) -> None:
        if what == "compared":
            policy = BatchPolicy(run["requests"], run["micro_batch"], run["resident"])
            run.update(predicted(spec, profile, mean_prompt, gen_len, policy, run["mode"],
                                 run.get("resident_expert_share")))
        result["runs"].append({**run, "part": what})
        log.info("%s %s %s: %.2f tokens/s end to end, %.2f decode, %.1f MB/token, exact %s", what, run["mode"],
                 run["label"], run["tokens_per_s"], run["decode_tokens_per_s"], run["bytes_per_token"] / 1e6,
                 run["exact"])
        save()

    for repeat in range(repeats):  # interleaved: every schedule at every policy, then again
        for policy in compared:
            for mode in MODES + (("sequential",) if policy in sequential_at else ()):
                run = measure_schedule(model_dir, prompts, gen_len, policy, mode, reference, hot, options, table,
                                       hot_count)
                record({**run, "repeat": repeat}, "compared")
            if accelerate == "repeats" or (accelerate == "once" and repeat == 0):
                run = measure_accelerate(model_dir, prompts[:policy.requests], gen_len, policy.resident,
                                         reference[:policy.requests], spec, options.drop_page_cache)
                record({**asdict(policy), "label": policy.label, **run, "repeat": repeat}, "compared")
    if sweep:
        plan = _klotski_plan(result["klotski_times"], table, hot, sweep, hot_count, spec, fingerprint.top_k)
        result["klotski_plan"] = plan
        ns = sorted(set(sweep[2]) | {plan["group_size"]})
        for repeat in range(repeats):
            for n in ns:
                policy = BatchPolicy(n * sweep[0], sweep[0], sweep[1])
                run = measure_schedule(model_dir, prompts, gen_len, policy, "klotski", reference, hot, options, table,
                                       plan["hot_count"])
                record({**run, "repeat": repeat, "group_size": n}, "sweep")
    for policy in grid:
        run = measure_schedule(model_dir, prompts, gen_len, policy, "cgopipe", reference, hot, options)
        run.update(predicted(spec, profile, mean_prompt, gen_len, policy))
        record(run, "grid")
    result.update(summary(result))
    save()
    if plot_path:
        from experiments.bench_batch_plot import plot_bench_batch

        plot_bench_batch(result, plot_path)
    return result


def _refuse_early(spec, accelerate: str, correlation: str | None, hot_count: int | None,
                  compared: list[BatchPolicy], sweep: tuple[int, float, list[int]] | None) -> None:
    """Refuse, before any work, an unknown accelerate setting, a correlation table of another
    model's shape (its fingerprint is checked once the model is loaded) and a hot count a policy
    cannot hold."""
    from offload_runtime.cgopipe.klotski import check_hot_count

    if accelerate not in ACCELERATE_RUNS:
        raise BenchBatchError(f"accelerate runs are one of {', '.join(ACCELERATE_RUNS)}, not {accelerate!r}")
    if correlation is not None:
        _check_table_shape(correlation, spec)
    if hot_count is not None:
        for policy in [*compared, *([BatchPolicy(sweep[0], sweep[0], sweep[1])] if sweep else [])]:
            check_hot_count(hot_count, spec.num_experts, policy.resident)


def _hardware_profile(model_dir: str, hardware: str | None, options: RuntimeOptions):
    """The HRM's hardware: the named or saved profile, else this machine measured, its disk link
    (without a GPU) at the rate our store reads experts."""
    from offload_runtime.planning.hardware import load_profile, measure_profile

    profile = load_profile(hardware) if hardware else measure_profile(Path(model_dir))
    if hardware is None and profile.gpu is None:  # the link is what our store reads experts at
        profile = dataclasses.replace(profile, disk_to_cpu=store_read_bandwidth(model_dir, options),
                                      notes=profile.notes + "; disk_to_cpu: expert reads of the store")
    return profile


def _policy_settings(compared: list[BatchPolicy], sequential_at: list[BatchPolicy], grid: list[BatchPolicy],
                     accelerate: str) -> dict[str, Any]:
    """The settings that say which policies ran where, as the JSON records them."""
    return {"main_policy": asdict(compared[0]), "compared": [p.label for p in compared],
            "sequential_at": [p.label for p in sequential_at], "grid": [p.label for p in grid],
            "accelerate": {"runs": accelerate, "offload": "disk (an offload folder)",
                           "batch": "all N requests in one generate",
                           "budget": "non-expert weights + the other schedules' expert slots"},
            "hrm": "hrm.estimate_schedule per mode at the mean prompt length"}


def _klotski_times(plain, layers, spec, profile, micro_batch: int, context: int) -> dict[str, float]:
    from offload_runtime.planning.klotski_measure import measure_klotski_times

    return measure_klotski_times(plain, layers, micro_batch, context, spec.expert_bytes,
                                 profile.link_bandwidth).to_dict()


def _klotski_plan(times: dict[str, float], table, hot, sweep: tuple[int, float, list[int]], hot_count: int | None,
                  spec, top_k: int) -> dict[str, Any]:
    """Klotski's planner on the measured times and the table's layer shares (uniform without one)."""
    import torch

    from offload_runtime.planning.klotski import KlotskiTimes, plan_group

    micro_batch, resident_fraction, ns = sweep
    n_experts = spec.num_experts
    resident = round(resident_fraction * n_experts)
    ranked = torch.argsort(-torch.as_tensor(hot, dtype=torch.float64), dim=-1, stable=True).tolist()
    if table is not None and table.layer0_counts.sum() > 0:
        counts = torch.cat([table.layer0_counts.sum(0), table.pairs[0].sum(1)])  # [L, E]: layer 0, then 1..L-1
        shares = (counts / counts.sum(-1, keepdim=True) * top_k).tolist()
    else:
        shares = [[top_k / n_experts] * n_experts for _ in ranked]
    plan = plan_group(KlotskiTimes(**times), shares, [set(order[:resident]) for order in ranked], micro_batch,
                      max_group=max(ns), top_k=top_k, hot_count=hot_count)
    return plan.to_dict()


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """Medians and spreads per policy and schedule; the ratios the issue's targets name."""
    runs = result["runs"]
    link = result["hardware_profile"]["disk_to_cpu"] if result["hardware_profile"]["gpu"] is None \
        else result["hardware_profile"]["cpu_to_gpu"]
    by_policy: dict[str, Any] = {}
    for label in result["settings"]["compared"]:
        mine = [r for r in runs if r["part"] == "compared" and r["label"] == label]
        modes = {}
        for mode in dict.fromkeys(r["mode"] for r in mine):
            of = [r for r in mine if r["mode"] == mode]
            modes[mode] = {key: median_spread([r[key] for r in of])
                           for key in ("tokens_per_s", "decode_tokens_per_s", "bytes_per_token", "decode_bytes_per_token")}
            if mode.startswith("klotski"):
                modes[mode]["activated_share"] = of[0]["activated_share"]
            if "predicted_tokens_per_s" in of[0]:  # the HRM's, the same in every repeat
                modes[mode].update(_prediction(of[0], modes[mode]))
            # the link's bound: decode tokens/s if the link moved this mode's bytes and nothing else waited
            moved = modes[mode]["decode_bytes_per_token"]["median"]
            modes[mode]["decode_link_bound_tokens_per_s"] = link / moved if moved else None

        def ratio(a: str, b: str, modes: dict[str, Any] = modes) -> float:
            return modes[a]["tokens_per_s"]["median"] / modes[b]["tokens_per_s"]["median"]

        by_policy[label] = {"modes": modes, "klotski_over_cgopipe": ratio("klotski", "cgopipe"),
                            "klotski_paper_over_cgopipe": ratio("klotski-paper", "cgopipe"),
                            "cgopipe_over_zigzag": ratio("cgopipe", "zigzag"),
                            "klotski_over_zigzag": ratio("klotski", "zigzag")}
        if "sequential" in modes:
            by_policy[label]["cgopipe_over_sequential"] = ratio("cgopipe", "sequential")
        if "accelerate" in modes:
            by_policy[label]["cgopipe_over_accelerate"] = ratio("cgopipe", "accelerate")
            by_policy[label]["klotski_over_accelerate"] = ratio("klotski", "accelerate")
    out: dict[str, Any] = {"by_policy": by_policy, "all_exact": all(r["exact"] for r in runs),
                           "more_experts": more_experts([r["requests"] for r in runs if r["part"] == "compared"])}
    predicted_modes = [m for row in by_policy.values() for m in row["modes"].values() if "predicted_tokens_per_s" in m]
    if len(predicted_modes) > 1:  # does the HRM rank the schedules (and policies) as they measure?
        out["hrm_schedules"] = {"pairs": len(predicted_modes), **{
            f"spearman_{key}": spearman([m[f"predicted_{key}"] for m in predicted_modes],
                                        [m[key]["median"] for m in predicted_modes])
            for key in ("tokens_per_s", "decode_tokens_per_s")}}
    sweep = [r for r in runs if r["part"] == "sweep"]
    if sweep:
        measured = {n: median_spread([r["tokens_per_s"] for r in sweep if r["group_size"] == n])
                    for n in sorted({r["group_size"] for r in sweep})}
        best = max(measured, key=lambda n: measured[n]["median"])
        chosen = result["klotski_plan"]["group_size"]
        out["klotski_sweep"] = {"tokens_per_s_by_group_size": measured, "best_group_size": best,
                                "planner_group_size": chosen,
                                "planner_gap": 1 - measured[chosen]["median"] / measured[best]["median"]}
    grid = [r for r in runs if r["part"] == "grid"]
    if grid:
        choice = max(grid, key=lambda r: r["predicted_decode_tokens_per_s"])
        best_run = max(grid, key=lambda r: r["decode_tokens_per_s"])
        out["hrm"] = {"spearman": spearman([r["predicted_decode_tokens_per_s"] for r in grid],
                                           [r["decode_tokens_per_s"] for r in grid]),
                      "planner_choice": choice["label"], "best_measured": best_run["label"],
                      "planner_gap": 1 - choice["decode_tokens_per_s"] / best_run["decode_tokens_per_s"],
                      "grid_size": len(grid)}
    return out


def _prediction(run: dict[str, Any], stats: dict[str, Any]) -> dict[str, Any]:
    """The HRM's end-to-end and decode tokens/s for a mode, and each over the measured median."""
    return {"predicted_tokens_per_s": run["predicted_tokens_per_s"],
            "predicted_decode_tokens_per_s": run["predicted_decode_tokens_per_s"],
            "prediction_over_measured": {key: run[f"predicted_{key}"] / stats[key]["median"]
                                         for key in ("tokens_per_s", "decode_tokens_per_s")}}


def more_experts(requests: list[int], layouts: tuple[tuple[int, int], ...] = ((16, 2), (64, 2), (64, 8), (128, 8),
                                                                           (256, 8))) -> dict[str, dict[int, float]]:
    """The share of a layer's experts one decode step of N requests activates under uniform
    routing (the HRM's `expected_experts`), for layouts of E experts and top-k as real models
    have them: what Klotski saves against CGOPipe's every-expert stream is at most 1 − that share
    (skewed routing activates fewer)."""
    from offload_runtime.planning.hrm import expected_experts

    return {f"E={e} top-{k}": {n: expected_experts(n, e, k) / e for n in sorted(set(requests))} for e, k in layouts}
