"""`prescient bench`: decode speed and memory of the offloading runtime per budget, predictor and
cache policy, beside the all-resident model and accelerate's disk offload.

    prescient bench --model DIR --json OUT.json --plot OUT.png [--budgets 0.25,0.5,1.0] \
        [--predictors none,freq,corr,oracle,sida=PATH] [--policies lru,lfu,fifo,mrs] \
        [--grid default|full | --runs PRED:POLICY@BUDGET,...] [--train-trace DIR] \
        [--new-tokens N] [--prompts K] [--prompt-tokens T] [--in-process]

How each number is measured is in `METHOD` (also written into the JSON as `method`).

JSON: settings, machine, model {dir, expert_bytes, total_expert_bytes, ...}, prompts,
method, baselines {all_resident, accelerate_disk}, runs [records], hash_thread_cost, ratios
{RUN at the headline budget: tokens_per_s, vs_none_lru, vs_all_resident, vs_accelerate_disk},
complete. A record: label, kind, [predictor, policy, budget], tokens_per_s, peak_rss_mb,
hit_rate, stall_seconds, bytes_moved, late_tables, exact, decode_tokens, decode_seconds,
prefill_seconds, load_seconds, rss_after_load_mb, load_peak_rss_mb, peak_rss_scope, stats
(the runtime's, over the decode windows), and error where a run failed.

Wired into `prescient.cli` with `add_parser(sub)` and `run(args)`.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import logging
import multiprocessing
import os
import platform
import resource
import shutil
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from predictor.base import ExpertPredictor
from prescient.atomic import write_json_atomic
from prescient.errors import PrescientError

log = logging.getLogger(__name__)

METHOD = {
    "prompts": "the first K+1 texts of the corpus split with at least T tokens, cut to T tokens; the first is a "
               "warm-up generated untimed before the K timed ones in every run (the cache carries over from prompt "
               "to prompt, as when serving); batch size 1, greedy, exactly N new tokens",
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
BUILTIN = ("none", "freq", "token", "corr", "oracle")  # besides NAME=PATH artifacts
BASELINES = ("all_resident", "accelerate_disk")
HEADLINE_BUDGET = 0.5
# imported once by the forkserver, so that each run's process starts with them (and the model's own module)
PRELOAD = ["torch", "transformers.modeling_utils", "transformers.generation.utils", "accelerate",
           "offload_runtime.loader", __name__]
_DELTAS = ("forwards", "accesses", "hits", "misses", "prefetch_inserts", "prefetch_hits", "wasted_prefetches",
           "evictions", "bytes_moved", "loads", "demand_loads", "prefetch_loads", "stall_seconds", "late_tables",
           "tables_on_time")


class BenchError(PrescientError):
    """A benchmark was asked for with missing or malformed inputs."""


@dataclass(frozen=True)
class RunSpec:
    predictor: str  # "none", a built-in name, or the NAME of a NAME=PATH artifact
    policy: str
    budget: float

    @property
    def label(self) -> str:
        return f"{self.predictor}+{self.policy}@{self.budget:g}"


@dataclass
class Job:
    """One measurement (`measure`), picklable for the process that runs it."""

    kind: str  # "all_resident" | "accelerate_disk" | "offloaded"
    model_dir: str
    prompts: list[list[int]]  # timed prompts (token ids)
    new_tokens: int
    warmup: list[list[int]] = field(default_factory=list)  # generated untimed first
    warmup_tokens: int = 0
    pad_token_id: int | None = None
    threads: int = 1
    budget: float = 1.0
    policy: str = "lru"
    predictor: str | None = None  # "oracle" (path: its trace) or another name (path: an artifact)
    predictor_path: str | None = None
    ignore_tables: bool = False
    store: str = "disk"
    drop_page_cache: bool = True
    work_dir: str | None = None  # accelerate's offload folder is made below it
    trace_out: str | None = None  # all_resident: write the router choices of every prompt here


# --- the grid --------------------------------------------------------------------------------
def default_grid(budgets: list[float], predictors: list[str], policies: list[str]) -> list[RunSpec]:
    """Per budget: none+lru; every predictor with mrs and lru; sida (if given) with every policy."""
    runs = []
    for budget in budgets:
        runs += [RunSpec("none", "lru", budget)] if "none" in predictors else []
        for name in (p for p in predictors if p != "none"):
            chosen = ("mrs", "lru", *policies) if name == "sida" else ("mrs", "lru")
            runs += [RunSpec(name, policy, budget) for policy in dict.fromkeys(chosen)]
    return runs


def full_grid(budgets: list[float], predictors: list[str], policies: list[str]) -> list[RunSpec]:
    return [RunSpec(p, policy, b) for b in budgets for p in predictors for policy in policies]


def parse_runs(text: str) -> list[RunSpec]:
    """`none:lru@0.5,sida:mrs@0.25` -> run specs."""
    runs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        head, _, budget = item.partition("@")
        predictor, _, policy = head.partition(":")
        try:
            value = float(budget)
        except ValueError:
            value = None
        if not (predictor and policy) or value is None:
            raise BenchError(f"--runs entry {item!r} is not PREDICTOR:POLICY@BUDGET (e.g. sida:mrs@0.5)")
        runs.append(RunSpec(predictor, policy, value))
    return runs


def check_grid(runs: list[RunSpec], predictors: dict[str, str | None], train_trace: str | Path | None) -> None:
    """Fail before any work on an unknown predictor, policy or budget, or a fit without a trace."""
    from cache import POLICIES

    for name, path in predictors.items():
        if path is None and name not in BUILTIN:
            raise BenchError(f"unknown predictor {name!r}; use {', '.join(BUILTIN)} or NAME=PATH (an artifact)")
        if path is None and name in ("freq", "token", "corr") and train_trace is None:
            raise BenchError(f"predictor {name!r} is fit on a trace: pass --train-trace DIR (make one with "
                             "`prescient trace --model DIR --dataset stdlib-code --split train --out DIR`)")
    for spec in runs:
        if spec.predictor not in predictors:
            raise BenchError(f"run {spec.label} uses predictor {spec.predictor!r}, which --predictors does not name")
        if spec.policy.lower() not in POLICIES:
            raise BenchError(f"run {spec.label}: unknown policy {spec.policy!r}; known: {', '.join(POLICIES)}")
        if not 0 < spec.budget <= 1:
            raise BenchError(f"run {spec.label}: budget {spec.budget} is not a fraction in (0, 1]")


def prompt_ids(tokenizer, texts: list[str], count: int, tokens: int) -> list[list[int]]:
    """The first `count` texts with at least `tokens` tokens, cut to `tokens` tokens."""
    out = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        out += [ids[:tokens]] if len(ids) >= tokens else []
        if len(out) == count:
            return out
    raise BenchError(f"{len(out)} of the {len(texts)} prompt texts have {tokens} tokens; {count} are needed")


# --- one measurement (in the job's own process) ---------------------------------------------
class _IgnoredTables(ExpertPredictor):
    """Runs `inner` on the hash-building thread as usual but publishes all-zero scores, which the
    runtime turns into no prefetches: the thread's cost without its benefit."""

    kind = "ignored-tables"

    def __init__(self, inner: ExpertPredictor) -> None:
        self.inner, self.meta = inner, inner.meta

    def predict(self, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(self.inner.predict(input_ids))

    def start(self, batch_size: int) -> Any:
        return self.inner.start(batch_size)

    def step(self, state: Any, token_ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(self.inner.step(state, token_ids))


class _DecodeClock:
    """A generate() streamer noting when each put arrives (the prompt, then each new token); with
    a runtime, it snapshots the runtime's stats at the end of prefill and at the end."""

    def __init__(self, runtime=None) -> None:
        self.runtime, self.times, self.stats = runtime, [], []

    def put(self, _value: Any) -> None:
        if len(self.times) == 1 and self.runtime is not None:
            self.stats.append(self.runtime.stats())  # before the clock: counted in prefill
        self.times.append(time.perf_counter())

    def end(self) -> None:
        if self.runtime is not None:
            self.stats.append(self.runtime.stats())


def _status_mb(name: str) -> float | None:
    """A field of /proc/self/status (VmRSS, VmHWM) in MiB; None off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(name + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _release_freed_memory() -> None:
    """Free what loading dropped (the checkpoint's expert tensors; in-process, the last run's model)
    and hand freed heap memory back to the OS (glibc `malloc_trim`), so that RSS shows live memory."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _reset_peak() -> bool:
    """Reset the process's peak RSS (VmHWM) to its current RSS; False where the kernel lacks it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return _status_mb("VmHWM") is not None
    except OSError:
        return False


def _generate(model: nn.Module, ids: list[int], new_tokens: int, pad: int | None, streamer=None) -> list[int]:
    input_ids = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad, streamer=streamer)
    return out[0, len(ids):].tolist()


def _record_routes(model: nn.Module, job: Job, out: Path) -> list[list[int]]:
    """Generate the warm-up and timed prompts with router hooks on, and write the router's choices
    of every forward as a trace (one sequence per prompt: the prompt, then the fed new tokens);
    returns the timed prompts' new tokens."""
    from prescient.arch import find_moe_layers
    from prescient.fingerprint import fingerprint_model
    from prescient.traces import TraceManifest, TraceWriter
    from training.router_hooks import RouterRecorder
    from training.tracing import rows_of_batch

    layers = find_moe_layers(model)
    recorder = RouterRecorder(layers)
    top_t = min(30, layers[0].num_experts)
    parts: list[dict[str, torch.Tensor]] = []
    sequences = [(p, job.warmup_tokens) for p in job.warmup] + [(p, job.new_tokens) for p in job.prompts]

    def after(_module, _args, kwargs, _output) -> None:
        ids = kwargs["input_ids"]
        logits, selected = recorder.stacked(*ids.shape)
        parts.append(rows_of_batch(ids, torch.ones_like(ids), logits, selected, seq, top_t))

    columns: list[dict[str, torch.Tensor]] = []
    generated = []
    handle = model.register_forward_hook(after, with_kwargs=True)
    try:
        with recorder.recording():
            for seq, (ids, new_tokens) in enumerate(sequences):
                parts.clear()
                generated.append(_generate(model, ids, new_tokens, job.pad_token_id))
                rows = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
                rows["position"] = torch.arange(len(rows["token_id"]), dtype=torch.int32)
                columns.append(rows)
    finally:
        handle.remove()
    manifest = TraceManifest(fingerprint_model(model, layers), "bench-generation", "bench", top_t,
                             settings={"prompt_tokens": [len(p) for p, _ in sequences],
                                       "new_tokens": [n for _, n in sequences]})
    writer = TraceWriter(out, manifest)
    writer.add_shard({k: torch.cat([c[k] for c in columns]) for k in columns[0]}, sequences=len(columns))
    writer.finish()
    return generated[len(job.warmup):]


def _device_map(model: nn.Module, offloaded: set[str]) -> dict[str, str]:
    """Modules named in `offloaded` -> "disk", every other branch -> "cpu"."""
    out: dict[str, str] = {}

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            path = prefix + name
            if path in offloaded:
                out[path] = "disk"
            elif any(o.startswith(path + ".") for o in offloaded):
                visit(child, path + ".")
            else:
                out[path] = "cpu"

    visit(model, "")
    return out


def _load_accelerate(job: Job, stack: ExitStack) -> nn.Module:
    """The model with its routed experts offloaded to disk by transformers + accelerate."""
    from transformers import AutoConfig

    from prescient.arch import find_moe_layers
    from prescient.loading import model_class

    config = AutoConfig.from_pretrained(job.model_dir)
    with torch.device("meta"):
        skeleton = model_class(config).from_config(config)
    names = {id(module): name for name, module in skeleton.named_modules()}
    device_map = _device_map(skeleton, {names[id(layer.experts)] for layer in find_moe_layers(skeleton)})
    folder = Path(tempfile.mkdtemp(prefix="accelerate-offload-", dir=job.work_dir))
    stack.callback(shutil.rmtree, folder, True)
    model = model_class(config).from_pretrained(job.model_dir, dtype=torch.float32, device_map=device_map,
                                                offload_folder=str(folder)).eval()
    if job.drop_page_cache:
        fds = [os.open(path, os.O_RDONLY) for path in sorted(folder.rglob("*")) if path.is_file()]
        stack.callback(lambda: [os.close(fd) for fd in fds])

        def drop(*_args) -> None:
            for fd in fds:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

        for fd in fds:
            os.fsync(fd)  # dirty pages of the just-written files cannot be dropped
        drop()
        for layer in find_moe_layers(model):
            layer.experts.register_forward_hook(drop)
    return model


def _decode_stats(pairs: list[list]) -> dict[str, Any]:
    """Runtime stats summed over the decode windows ((after prefill, end) snapshots per prompt)."""
    total: dict[str, Any] = {k: sum(getattr(b, k) - getattr(a, k) for a, b in pairs) for k in _DELTAS}
    total["stall_seconds"] = round(total["stall_seconds"], 4)
    total["hit_rate"] = total["hits"] / total["accesses"] if total["accesses"] else None
    inserts = total["prefetch_inserts"]
    total["prefetch_accuracy"] = total["prefetch_hits"] / inserts if inserts else None
    total["slots"], total["slot_bytes"] = pairs[0][1].slots, pairs[0][1].slot_bytes
    return total


def measure(job: Job) -> dict[str, Any]:
    """Load the job's model, warm up, time the prompts' decode; see METHOD."""
    threads = torch.get_num_threads()
    torch.set_num_threads(job.threads)
    try:
        return _measure(job)
    finally:
        torch.set_num_threads(threads)


def _load(job: Job, stack: ExitStack) -> tuple[nn.Module, Any, dict[str, Any]]:
    """The job's model, its offload runtime (None for the baselines; closed by `stack`), and what
    the job reports about it."""
    from offload_runtime.loader import load_offloaded
    from predictor.artifact import load_predictor
    from predictor.baselines import OraclePredictor
    from prescient.arch import find_moe_layers
    from prescient.fingerprint import fingerprint_model
    from prescient.loading import load_model
    from prescient.traces import load_trace

    if job.kind == "all_resident":
        model, layers = load_model(job.model_dir, dtype=torch.float32)
        return model, None, {"fingerprint": fingerprint_model(model, layers).to_dict()}
    if job.kind == "accelerate_disk":
        model = _load_accelerate(job, stack)
        return model, None, {"offloaded_modules": len(find_moe_layers(model))}
    predictor = None
    if job.predictor is not None:
        predictor = (OraclePredictor(load_trace(job.predictor_path)) if job.predictor == "oracle"
                     else load_predictor(job.predictor_path))
        predictor = _IgnoredTables(predictor) if job.ignore_tables else predictor
    model = load_offloaded(job.model_dir, predictor=predictor, policy=job.policy, budget=job.budget,
                           store=job.store, drop_page_cache=job.drop_page_cache)
    runtime = stack.enter_context(model.offload_runtime)
    layers, store = runtime.layers, runtime.store
    return model, runtime, {"model_info": {
        "expert_bytes": store.expert_nbytes, "total_expert_bytes": store.total_nbytes, "n_moe_layers": len(layers),
        "n_experts": layers[0].num_experts, "top_k": layers[0].top_k}}


def _measure(job: Job) -> dict[str, Any]:
    began = time.perf_counter()
    with ExitStack() as stack:
        model, runtime, extra = _load(job, stack)
        load_seconds = time.perf_counter() - began
        recorded = _record_routes(model, job, Path(job.trace_out)) if job.trace_out is not None else None
        _release_freed_memory()
        load_peak, after_load = _status_mb("VmHWM"), _status_mb("VmRSS")
        reset = _reset_peak()
        for ids in job.warmup:
            _generate(model, ids, job.warmup_tokens, job.pad_token_id)
        token_ids, decode_s, prefill_s, snapshots = [], 0.0, 0.0, []
        for ids in job.prompts:
            clock = _DecodeClock(runtime)
            token_ids.append(_generate(model, ids, job.new_tokens, job.pad_token_id, clock))
            prefill_s += clock.times[1] - clock.times[0]
            decode_s += clock.times[len(token_ids[-1])] - clock.times[1]
            snapshots.append(clock.stats)
        peak = _status_mb("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if recorded is not None and recorded != token_ids:
        raise BenchError("the all-resident model generated other tokens with router hooks on than without: "
                         "generation is not deterministic here, so the oracle trace would not match")
    decode_tokens = sum(len(ids) - 1 for ids in token_ids)
    return {
        "token_ids": token_ids, "tokens_per_s": decode_tokens / decode_s if decode_s > 0 else None,
        "peak_rss_mb": round(peak, 1), "decode_tokens": decode_tokens, "decode_seconds": round(decode_s, 4),
        "prefill_seconds": round(prefill_s, 4), "load_seconds": round(load_seconds, 3),
        "rss_after_load_mb": after_load and round(after_load, 1), "load_peak_rss_mb": load_peak and round(load_peak, 1),
        "peak_rss_scope": "after load (VmHWM reset)" if reset else "process lifetime (ru_maxrss)",
        "stats": _decode_stats(snapshots) if runtime is not None else None, "pid": os.getpid(),
        "load_average": [round(x, 2) for x in os.getloadavg()], **extra,
    }


# --- the benchmark ---------------------------------------------------------------------------
def _serve(job: Job, connection) -> None:
    """A run's own process: measure and send back the result, or the error as text (not every
    exception unpickles). No weight-loading progress bars between the benchmark's own."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        connection.send(("ok", measure(job)))
    except Exception as exc:
        connection.send(("error", f"{type(exc).__name__}: {exc}"))


class Executor:
    """Runs jobs one at a time: each in a fresh process forked from a forkserver that has imported
    torch and transformers once (`isolate`), or else in this process. A run's process that dies
    (e.g. killed for memory) fails that run only."""

    def __init__(self, isolate: bool, preload: tuple[str, ...] = ()) -> None:
        self._context = None
        if isolate:
            self._context = multiprocessing.get_context("forkserver")
            self._context.set_forkserver_preload([*PRELOAD, *preload])  # a module that fails to import is skipped

    def __call__(self, job: Job) -> dict[str, Any]:
        if self._context is None:
            return measure(job)
        receiver, sender = self._context.Pipe(duplex=False)
        process = self._context.Process(target=_serve, args=(job, sender), name=f"bench-{job.kind}")
        process.start()
        sender.close()
        try:
            status, value = receiver.recv()
        except EOFError:
            status, value = "died", None
        except BaseException:  # interrupted: the run's process goes too
            process.terminate()
            raise
        finally:
            process.join()
            receiver.close()
        if status == "died":
            raise BenchError(f"the run's process died with exit code {process.exitcode} "
                             "(negative: killed by that signal; -9 is often the out-of-memory killer)")
        if status == "error":
            raise BenchError(value)
        return value


def _head(spec: RunSpec | None, kind: str) -> dict[str, Any]:
    head: dict[str, Any] = {"label": spec.label if spec else kind, "kind": kind}
    if spec is not None:
        head.update(predictor=spec.predictor, policy=spec.policy, budget=spec.budget)
    return head


def _record(spec: RunSpec | None, kind: str, result: dict[str, Any], reference: list[list[int]]) -> dict[str, Any]:
    """A job's JSON record: the spec, the headline numbers, exactness, then all it measured."""
    ids = result.pop("token_ids")
    stats = result.get("stats") or {}
    return {**_head(spec, kind), "tokens_per_s": result.pop("tokens_per_s"),
            "peak_rss_mb": result.pop("peak_rss_mb"), "hit_rate": stats.get("hit_rate"),
            "stall_seconds": stats.get("stall_seconds"), "bytes_moved": stats.get("bytes_moved"),
            "late_tables": stats.get("late_tables"),
            "exact": len(ids) > 0 and all(run == ref[: len(run)] for run, ref in zip(ids, reference)), **result}


def _run(execute: Executor, job: Job, spec: RunSpec | None, reference: list[list[int]]) -> dict[str, Any]:
    """Execute one job and return its record; a failed job (e.g. out of memory) is recorded with
    its error, and the benchmark goes on."""
    try:
        return _record(spec, job.kind, execute(job), reference)
    except Exception as exc:
        log.error("run %s failed: %r", _head(spec, job.kind)["label"], exc)
        return {**_head(spec, job.kind), "tokens_per_s": None, "peak_rss_mb": None, "exact": False,
                "error": f"{type(exc).__name__}: {exc}"}


def ratios(runs: list[dict[str, Any]], baselines: dict[str, dict[str, Any]], budget: float) -> dict[str, Any]:
    """Each run at `budget`: its tokens/s over none+lru's at that budget, and over each baseline's
    (null where a side is missing)."""
    key = ("none", "lru", budget)
    none_lru = next((r for r in runs if (r.get("predictor"), r.get("policy"), r.get("budget")) == key), {})
    sides = {"vs_none_lru": none_lru.get("tokens_per_s"),
             **{f"vs_{name}": baselines.get(name, {}).get("tokens_per_s") for name in BASELINES}}
    return {r["label"]: {"tokens_per_s": r["tokens_per_s"],
                         **{key: r["tokens_per_s"] / side if side else None for key, side in sides.items()}}
            for r in runs if r.get("budget") == budget and r.get("tokens_per_s")}


def machine_info(threads: int) -> dict[str, Any]:
    import accelerate
    import psutil
    import transformers

    return {"cpu_count": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)), "torch_threads": threads,
            "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "load_average_at_start": [round(x, 2) for x in os.getloadavg()], "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__, "accelerate": accelerate.__version__}


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
    hash_cost_predictor: str | None = None,
    threads: int | None = None,
    store: str = "disk",
    drop_page_cache: bool = True,
    isolate: bool = True,
    work_dir: str | Path | None = None,
    json_path: str | Path | None = None,
    plot_path: str | Path | None = None,
) -> dict[str, Any]:
    """Measure the baselines, every run of `runs` and the hash thread's cost; returns the JSON
    of the module doc, also written to `json_path` after every run (`complete` turns true at
    the end). Prompts: the first `timed_prompts` + 1 of `texts` with `prompt_tokens` tokens
    (the first is the warm-up). `predictors`: name -> artifact path, or None for a built-in
    (freq, token, corr: fit on `train_trace`; oracle; none)."""
    from transformers import AutoConfig

    from prescient.fingerprint import ModelFingerprint
    from prescient.loading import load_tokenizer

    if hash_cost_predictor is not None and hash_cost_predictor not in predictors:
        raise BenchError(f"hash-cost predictor {hash_cost_predictor!r} is not among the predictors")
    used = {spec.predictor for spec in runs} | {hash_cost_predictor}
    predictors = {name: path for name, path in predictors.items() if name in used}
    check_grid(runs, predictors, train_trace)
    if min(new_tokens, baseline_tokens) < 2 or timed_prompts < 1:
        raise BenchError("decode speed needs at least 2 new tokens and 1 timed prompt")
    threads = threads or torch.get_num_threads()
    tokenizer = load_tokenizer(model_dir)
    ids = prompt_ids(tokenizer, texts, timed_prompts + 1, prompt_tokens)
    temporary = tempfile.TemporaryDirectory(prefix="prescient-bench-") if work_dir is None else None
    work = Path(work_dir or temporary.name)
    work.mkdir(parents=True, exist_ok=True)
    base = Job("offloaded", str(model_dir), ids[1:], new_tokens, warmup=ids[:1], warmup_tokens=warmup_tokens,
               pad_token_id=tokenizer.pad_token_id, threads=threads, store=store, drop_page_cache=drop_page_cache,
               work_dir=str(work))
    result: dict[str, Any] = {
        "settings": {"budgets": sorted({r.budget for r in runs}), "policies": sorted({r.policy for r in runs}),
                     "predictors": {k: v and str(v) for k, v in predictors.items()}, "new_tokens": new_tokens,
                     "timed_prompts": timed_prompts, "prompt_tokens": prompt_tokens, "warmup_tokens": warmup_tokens,
                     "baseline_tokens": baseline_tokens, "train_trace": train_trace and str(train_trace),
                     "store": store, "drop_page_cache": drop_page_cache, "isolated_processes": isolate,
                     "headline_budget": HEADLINE_BUDGET},
        "machine": machine_info(threads), "model": {"dir": str(model_dir)},
        "prompts": {"warmup": ids[0], "timed": ids[1:]}, "method": METHOD,
        "baselines": {}, "runs": [], "hash_thread_cost": None, "ratios": {}, "complete": False,
    }

    def save() -> None:
        if json_path is not None:
            write_json_atomic(json_path, result)

    oracle_trace = work / "oracle-trace"
    total = 1 + ("accelerate_disk" in baselines) + len(runs) + 2 * (hash_cost_predictor is not None)
    try:
        model_type = AutoConfig.from_pretrained(model_dir).model_type
        preload = (f"transformers.models.{model_type}.modeling_{model_type}",)
        execute = Executor(isolate, preload)
        with tqdm(total=total, desc="bench", unit="run") as bar:
            bar.set_postfix_str("all_resident")
            ref = execute(replace(base, kind="all_resident",
                                  trace_out=str(oracle_trace) if "oracle" in predictors else None))
            reference = ref["token_ids"]
            fingerprint = ModelFingerprint.from_dict(ref.pop("fingerprint"))
            if "all_resident" in baselines:
                result["baselines"]["all_resident"] = _record(None, "all_resident", dict(ref), reference)
            bar.update()
            paths = {"oracle": str(oracle_trace), **_artifacts(predictors, fingerprint, train_trace, work)}
            if "accelerate_disk" in baselines:
                bar.set_postfix_str("accelerate_disk")
                job = replace(base, kind="accelerate_disk", prompts=ids[1:2], warmup=[], new_tokens=baseline_tokens)
                result["baselines"]["accelerate_disk"] = _run(execute, job, None, reference)
                bar.update()
            save()
            for spec in runs:
                bar.set_postfix_str(spec.label)
                job = replace(base, budget=spec.budget, policy=spec.policy, predictor_path=paths.get(spec.predictor),
                              predictor=None if spec.predictor == "none" else spec.predictor)
                result["runs"].append(record := _run(execute, job, spec, reference))
                result["model"].update(record.pop("model_info", None) or {})
                bar.update()
                save()
            if hash_cost_predictor is not None:
                result["hash_thread_cost"] = _hash_thread_cost(execute, base, hash_cost_predictor,
                                                               paths.get(hash_cost_predictor), reference, bar)
    finally:
        if temporary is not None:
            temporary.cleanup()
    result["ratios"] = ratios(result["runs"], result["baselines"], HEADLINE_BUDGET)
    result["complete"] = True
    save()
    if plot_path is not None:
        from experiments.bench_runtime_plot import plot_bench  # matplotlib only when plotting

        plot_bench(result, plot_path)
    bad = [r["label"] for r in [*result["runs"], *result["baselines"].values()] if not r["exact"]]
    if bad:
        log.warning("failed or not exact: %s", ", ".join(bad))
    return result


def _artifacts(predictors: dict[str, str | None], fingerprint, train_trace: str | Path | None,
               work: Path) -> dict[str, str]:
    """Predictor name -> artifact: the given ones, checked against the model, and freq / token /
    corr fit on the train trace and saved in `work`."""
    from experiments.evaluate import FITTED
    from predictor.artifact import read_predictor_meta, save_predictor
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
    warm = replace(base, budget=1.0, policy="lru", warmup=base.prompts, warmup_tokens=base.new_tokens)
    records = {}
    for key, job, spec in [
        ("with_thread_tables_ignored", replace(warm, predictor=name, predictor_path=path, ignore_tables=True),
         RunSpec(name, "lru", 1.0)),
        ("without_thread", warm, RunSpec("none", "lru", 1.0)),
    ]:
        bar.set_postfix_str(f"hash cost: {key}")
        records[key] = {**_run(execute, job, spec, reference), "label": f"hash_thread_cost/{key}"}
        records[key].pop("model_info", None)
        bar.update()
    speeds = [records[k]["tokens_per_s"] for k in records]
    return {"predictor": name, "budget": 1.0, "policy": "lru", **records,
            "tokens_per_s_ratio": speeds[0] / speeds[1] if all(speeds) else None}


# --- command line ----------------------------------------------------------------------------
def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="decode tokens/s and memory of the offloading runtime (JSON + PNG)")
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--json", required=True, help="results file (rewritten after every run)")
    p.add_argument("--plot", help="PNG of the results")
    p.add_argument("--budgets", default="0.25,0.5,1.0", help="expert memory, as fractions of all experts")
    p.add_argument("--predictors", default="none,freq,corr,oracle",
                   help=f"comma list of {', '.join(BUILTIN)} or NAME=ARTIFACT (e.g. sida=runs/sida)")
    p.add_argument("--policies", default="lru,lfu,fifo,mrs", help="policies for sida (default grid) or all (full)")
    p.add_argument("--grid", choices=("default", "full"), default="default",
                   help="default: per budget none+lru, each predictor with mrs and lru, sida with every policy; "
                        "full: budgets x predictors x policies")
    p.add_argument("--runs", help="these runs instead of a grid: PREDICTOR:POLICY@BUDGET,...")
    p.add_argument("--train-trace", help="trace that freq / token / corr are fit on")
    p.add_argument("--new-tokens", type=int, default=12, help="new tokens per timed prompt")
    p.add_argument("--prompts", type=int, default=2, help="timed prompts (one more is the warm-up)")
    p.add_argument("--prompt-tokens", type=int, default=16, help="tokens per prompt")
    p.add_argument("--warmup-tokens", type=int, default=4, help="new tokens of the untimed warm-up prompt")
    p.add_argument("--dataset", default="stdlib-code", help="corpus the prompts come from")
    p.add_argument("--split", default="validation")
    p.add_argument("--baselines", default=",".join(BASELINES), help=f"comma list of {', '.join(BASELINES)}")
    p.add_argument("--baseline-tokens", type=int, default=4, help="new tokens of the accelerate_disk run")
    p.add_argument("--hash-cost", default="auto",
                   help="predictor of hash_thread_cost; auto: sida if given, else skipped; off: skipped")
    p.add_argument("--threads", type=int, default=None, help="torch threads per run (default: torch's)")
    p.add_argument("--store", choices=("disk", "host"), default="disk", help="where the offloaded experts live")
    p.add_argument("--keep-page-cache", action="store_true", help="disk store: leave read pages in the page cache")
    p.add_argument("--in-process", action="store_true", help="every run in this process (quick checks)")
    p.add_argument("--work-dir", help="keep fitted predictors and the oracle trace here (default: a temporary dir)")
    return p


def run(args: argparse.Namespace) -> dict[str, Any]:
    from experiments.evaluate import parse_predictors
    from training.corpora import load_corpus

    predictors = parse_predictors(args.predictors)
    budgets, policies = [float(b) for b in _names(args.budgets)], _names(args.policies)
    grid = full_grid if args.grid == "full" else default_grid
    runs = parse_runs(args.runs) if args.runs else grid(budgets, list(predictors), policies)
    baselines = tuple(_names(args.baselines))
    if set(baselines) - set(BASELINES):
        raise BenchError(f"unknown baselines {sorted(set(baselines) - set(BASELINES))}; use {', '.join(BASELINES)}")
    hash_cost = {"auto": "sida" if "sida" in predictors else None, "off": None}.get(args.hash_cost, args.hash_cost)
    used = {spec.predictor for spec in runs} | {hash_cost}
    check_grid(runs, {k: v for k, v in predictors.items() if k in used}, args.train_trace)  # before reading the corpus
    texts = list(load_corpus(args.dataset, args.split)["text"][: 20 * (args.prompts + 1)])
    result = bench_runtime(
        args.model, texts, predictors=predictors, runs=runs, timed_prompts=args.prompts,
        prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, warmup_tokens=args.warmup_tokens,
        train_trace=args.train_trace, baselines=baselines, baseline_tokens=args.baseline_tokens,
        hash_cost_predictor=hash_cost, threads=args.threads, store=args.store, drop_page_cache=not args.keep_page_cache,
        isolate=not args.in_process, work_dir=args.work_dir, json_path=args.json, plot_path=args.plot,
    )
    print(summary(result))
    return result


def summary(result: dict[str, Any]) -> str:
    """One line per run and baseline: tokens/s, hit rate, peak RSS, exactness."""
    rows = [*result["baselines"].values(), *result["runs"]]
    lines = [f"{'run':<24} {'tokens/s':>9} {'hit rate':>9} {'peak MiB':>9}  exact"]
    for r in rows:
        speed = f"{r['tokens_per_s']:.2f}" if r.get("tokens_per_s") else "-"
        hit = f"{r['hit_rate']:.1%}" if r.get("hit_rate") is not None else "-"
        peak = f"{r['peak_rss_mb']:.0f}" if r.get("peak_rss_mb") else "-"
        error = f"  {r['error']}" if "error" in r else ""
        lines.append(f"{r['label']:<24} {speed:>9} {hit:>9} {peak:>9}  {r['exact']}{error}")
    cost = result.get("hash_thread_cost")
    if cost and cost.get("tokens_per_s_ratio"):
        lines.append(f"hash thread ({cost['predictor']}, tables ignored) / no thread at budget 1.0: "
                     f"{cost['tokens_per_s_ratio']:.3f}x decode tokens/s")
    return "\n".join(lines)
