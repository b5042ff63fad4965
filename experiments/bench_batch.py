"""`prescient bench-batch`: CGOPipe batch decoding against its baselines, and the HRM check.

Three throughputs at one policy (N requests, micro-batch size μ, resident expert fraction r_w),
all decode tokens per second (prefill excluded) over the same requests:

  cgopipe      the CGOPipe loop: experts beyond r_w stream from disk in pages, overlapped
  sequential   the same runtime and budget decoding its micro-batches one after another
  resident     plain batched `generate` with every weight resident

Then the validation of the HRM performance model: over a grid of policies, the CGOPipe loop's
measured throughput against the model's prediction for this machine's measured hardware profile
(Spearman rank correlation), and the planner's choice (the grid policy with the best prediction)
against the best measured one (`planner_gap`: how far below the best it measures).

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


BATCH_OPTIONS = RuntimeOptions(policy="fifo", drop_page_cache=True)  # CGOPipe chooses what stays resident
DEFAULT_GRID = ("8:4:0.5,16:4:0.5,32:4:0.5,32:8:0.5,16:8:0.25,32:8:0.25,32:4:0.25,16:4:0.75,32:16:0.75,8:2:0.75,"
                "64:16:0.5")


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
    raise SystemExit(f"{dataset}:{split} has only {len(prompts)} texts of the lengths needed; ask for fewer requests")


def store_read_bandwidth(model_dir: str, options: RuntimeOptions) -> float:
    """Bytes/s of the expert store of `options` reading one layer's experts into slots, the way
    a decode step streams them (a test on one sequential file overstates it here: expert reads
    are split by tensor and jump around the file)."""
    from offload_runtime.engine.loader import load_offloaded

    model = load_offloaded(model_dir, None, dataclasses.replace(options, budget=1 / 4))
    runtime = model.offload_runtime
    with runtime:
        n_experts = runtime.n_experts
        keys = [(1, e) for e in range(min(n_experts, runtime.pool.num_slots))]  # one layer, as a step streams it
        start = time.perf_counter()
        for slot, key in enumerate(keys):
            runtime.store.read(key, runtime.pool.view(slot))
        seconds = time.perf_counter() - start
    return len(keys) * runtime.pool.nbytes / runtime.pool.num_slots / seconds


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


def reference_outputs(model, prompts: list[list[int]], gen_len: int) -> list[list[int]]:
    """Each request generated alone by the plain, all-resident `model` (greedy)."""
    import torch

    with torch.inference_mode():
        return [model.generate(torch.tensor([p]), max_new_tokens=gen_len, do_sample=False,
                               pad_token_id=model.config.pad_token_id)[0, len(p):].tolist() for p in prompts]


def measure_resident(model, prompts: list[list[int]], gen_len: int) -> dict[str, Any]:
    """Plain batched greedy `generate`, all weights resident: decode time is the time of
    `gen_len` new tokens minus the time of one (prefill and the first token)."""
    import torch

    width = max(len(p) for p in prompts)
    pad = model.config.pad_token_id or 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width) >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()

    def timed(new: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=pad)
        return time.perf_counter() - start

    timed(1)  # warm-up
    first, full = timed(1), timed(gen_len)
    return {"decode_seconds": round(full - first, 4),
            "tokens_per_s": len(prompts) * (gen_len - 1) / (full - first)}


def measure_pipe(model_dir: str, prompts: list[list[int]], gen_len: int, policy: BatchPolicy, overlap: bool,
                 reference: list[list[int]], hot, options: RuntimeOptions) -> dict[str, Any]:
    """One CGOPipe run of `policy` on the runtime of `options` at the budget r_w needs."""
    from offload_runtime.cgopipe.pipe import CGOPipe, budget_fraction
    from offload_runtime.engine.loader import load_offloaded

    n_layers, n_experts = len(hot), len(hot[0])
    budget = budget_fraction(policy.resident, n_layers, n_experts)
    options = dataclasses.replace(options, budget=budget)
    model = load_offloaded(model_dir, None, options)
    requests = prompts[:policy.requests]
    n_micro = -(-policy.requests // policy.micro_batch)
    with model.offload_runtime as runtime, CGOPipe(model, policy.resident, hot=hot, overlap=overlap) as pipe:
        out = pipe.generate(requests, gen_len, micro_batch_size=policy.micro_batch, n_micro=n_micro,
                            pad_token_id=model.config.pad_token_id or 0)
        stats = runtime.stats()
    return {
        **asdict(policy), "label": policy.label, "mode": "cgopipe" if overlap else "sequential",
        "budget_fraction": budget, "tokens_per_s": pipe.stats.decode_tokens_per_s,
        "decode_seconds": round(pipe.stats.decode_seconds, 4), "prefill_seconds": round(pipe.stats.prefill_seconds, 4),
        "exact": out == reference[:policy.requests], "bytes_moved": stats.bytes_moved, "loads": stats.loads,
        "demand_loads": stats.demand_loads, "stall_seconds": stats.stall_seconds, "slots": stats.slots,
        "options": options.to_json(),
    }


def predicted_decode_tokens_per_s(spec, hardware, prompt_len: int, gen_len: int, policy: BatchPolicy) -> float:
    from offload_runtime.planning.hrm import Policy, Workload, estimate

    place = "cpu" if hardware.gpu is None else "gpu"
    hrm_policy = Policy(n_requests=policy.requests, micro_batch=policy.micro_batch, attention_on="cpu",
                        ffn_on=place, r_w=policy.resident)
    return estimate(spec, hardware, Workload(prompt_len, gen_len), hrm_policy).decode_tokens_per_s


def bench_batch(model_dir: str, json_path: str, plot_path: str | None, main: BatchPolicy, grid: list[BatchPolicy],
                sequential_at: list[BatchPolicy], gen_len: int, shortest: int, longest: int, hardware: str | None,
                trace: str | None, options: RuntimeOptions = BATCH_OPTIONS, dataset: str = "stdlib-code",
                split: str = "validation", threads: int = 1) -> dict[str, Any]:
    """`options`: the runtime's (its store and page cache), each run at the budget its r_w needs."""
    import torch

    from experiments.machine import machine_info
    from offload_runtime.planning.hardware import load_profile, measure_profile
    from offload_runtime.planning.hrm import ModelSpec
    from prescient.fingerprint import fingerprint_model
    from prescient.loading import load_model, load_tokenizer

    torch.set_num_threads(threads)
    policies = list(dict.fromkeys([main, *grid, *sequential_at]))
    sequential = {main, *sequential_at}
    count = max(p.requests for p in policies)
    prompts = request_prompts(load_tokenizer(model_dir), count, shortest, longest, dataset, split)
    profile = load_profile(hardware) if hardware else measure_profile(Path(model_dir))
    if hardware is None and profile.gpu is None:  # the link is what our store reads experts at
        profile = dataclasses.replace(profile, disk_to_cpu=store_read_bandwidth(model_dir, options),
                                      notes=profile.notes + "; disk_to_cpu: expert reads of the store")
    # the plain model serves the reference outputs, the all-resident run and the fingerprint; it
    # is loaded after the disk measurements and dropped before the offloaded runs, since its
    # memory-mapped checkpoint would keep the page cache from being dropped
    plain, layers = load_model(model_dir, dtype=torch.float32)
    hot = _hot_ranking(fingerprint_model(plain, layers), trace)
    spec = ModelSpec.from_config(model_dir)
    mean_prompt = round(sum(len(p) for p in prompts) / len(prompts))
    result: dict[str, Any] = {
        "settings": {"model": model_dir, "gen_len": gen_len, "prompt_tokens": [shortest, longest],
                     "dataset": f"{dataset}:{split}", "store": options.store,
                     "drop_page_cache": options.drop_page_cache,
                     "hot_ranking": trace or "expert id", "main_policy": asdict(main),
                     "grid": [p.label for p in grid]},
        "machine": machine_info(threads), "hardware_profile": profile.to_dict(), "runs": [],
    }

    def save() -> None:
        write_json_atomic(Path(json_path), result)

    log.info("reference: each of %d requests alone with the plain model", count)
    reference = reference_outputs(plain, prompts, gen_len)
    resident = measure_resident(plain, prompts[:main.requests], gen_len)
    del plain, layers
    result["resident"] = {**asdict(main), **resident}
    save()
    for index, policy in enumerate(policies):
        modes = (True, False) if policy in sequential else (True,)
        for overlap in modes:
            run = measure_pipe(model_dir, prompts, gen_len, policy, overlap, reference, hot, options)
            run["predicted_tokens_per_s"] = predicted_decode_tokens_per_s(spec, profile, mean_prompt, gen_len, policy)
            result["runs"].append(run)
            log.info("[%d/%d] %s %s: %.2f tokens/s (predicted %.2f), exact %s", index + 1, len(policies),
                     run["mode"], policy.label, run["tokens_per_s"], run["predicted_tokens_per_s"], run["exact"])
            save()
    result.update(summary(result))
    save()
    if plot_path:
        from experiments.bench_batch_plot import plot_bench_batch

        plot_bench_batch(result, plot_path)
    return result


def summary(result: dict[str, Any]) -> dict[str, Any]:
    main = result["settings"]["main_policy"]
    runs = result["runs"]
    at_main = {r["mode"]: r for r in runs if all(r[k] == v for k, v in main.items())}
    grid = [r for r in runs if r["mode"] == "cgopipe" and r["label"] in result["settings"]["grid"]]
    choice = max(grid, key=lambda r: r["predicted_tokens_per_s"])
    best = max(grid, key=lambda r: r["tokens_per_s"])
    cgopipe, sequential = at_main["cgopipe"]["tokens_per_s"], at_main["sequential"]["tokens_per_s"]
    by_policy = {r["label"]: r["tokens_per_s"] for r in runs if r["mode"] == "cgopipe"}
    return {
        "cgopipe_over_sequential_by_policy": {r["label"]: by_policy[r["label"]] / r["tokens_per_s"]
                                              for r in runs if r["mode"] == "sequential"},
        "cgopipe_tokens_per_s": cgopipe, "sequential_tokens_per_s": sequential,
        "resident_tokens_per_s": result["resident"]["tokens_per_s"],
        "cgopipe_over_sequential": cgopipe / sequential,
        "cgopipe_over_resident": cgopipe / result["resident"]["tokens_per_s"],
        "spearman": spearman([r["predicted_tokens_per_s"] for r in grid], [r["tokens_per_s"] for r in grid]),
        "planner_choice": choice["label"], "best_measured": best["label"],
        "planner_gap": 1 - choice["tokens_per_s"] / best["tokens_per_s"],
        "all_exact": all(r["exact"] for r in runs), "grid_size": len(grid),
    }


def _hot_ranking(fingerprint, trace: str | None) -> list[list[float]]:
    """[L][E] expert frequencies from `trace` (hottest experts stay resident), else by expert id."""
    import numpy as np

    from cache.simulator import expert_frequencies
    from prescient.traces import load_trace

    if trace is None:
        return [[-e for e in range(fingerprint.n_experts)] for _ in range(fingerprint.n_moe_layers)]
    loaded = load_trace(trace)
    fingerprint.require_same(loaded.fingerprint, f"trace {trace}")
    return np.asarray(expert_frequencies(loaded["topk_ids"].numpy(), fingerprint.n_experts)).tolist()
