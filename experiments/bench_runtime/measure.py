"""One `prescient bench` measurement: load a job's model, warm up, time the decode of its prompts
and take its peak memory (`measure`), in a fresh process of its own (`Executor`). How each number
is measured is in `experiments.bench_runtime.bench.METHOD`."""

from __future__ import annotations

import multiprocessing
import os
import resource
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch import nn

from experiments.bench_runtime.grid import BenchError
from experiments.machine import release_freed_memory
from experiments.bench_runtime.load import Job, load_job

# imported once by the forkserver, so that each run's process starts with them (and the model's own module)
PRELOAD = ["torch", "transformers.modeling_utils", "transformers.generation.utils", "accelerate",
           "offload_runtime.engine.loader", __name__]
_DELTAS = ("forwards", "accesses", "hits", "misses", "prefetch_inserts", "prefetch_hits", "wasted_prefetches",
           "evictions", "bytes_moved", "loads", "demand_loads", "prefetch_loads", "stall_seconds", "late_tables",
           "tables_on_time", "fine_accesses", "where_it_lives", "prediction_paused_forwards", "predictor_seconds")


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


def _reset_peak() -> bool:
    """Reset the process's peak RSS (VmHWM) to its current RSS; False where the kernel lacks it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return _status_mb("VmHWM") is not None
    except OSError:
        return False


def generate_ids(model: nn.Module, ids: list[int], new_tokens: int, job: Job, streamer=None) -> list[int]:
    """Exactly `new_tokens` new ids after prompt `ids`: greedy, or with `job.sample_seed` sampled
    under the model's generation settings from a torch seed made of that seed and the prompt, so
    that every run draws the same numbers for a prompt and, computing the same logits, the same
    tokens."""
    input_ids = torch.tensor([ids])
    if job.sample_seed is not None:
        torch.manual_seed(hash((job.sample_seed, *ids)) & 0xFFFF_FFFF)  # ints hash alike in every process
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                             do_sample=job.sample_seed is not None, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, pad_token_id=job.pad_token_id, streamer=streamer)
    return out[0, len(ids):].tolist()


def _record_routes(model: nn.Module, job: Job, out: Path) -> list[list[int]]:
    """Generate the warm-up and timed prompts with router hooks on, and write the router's choices
    of every forward as a trace (one sequence per prompt: the prompt, then the fed new tokens);
    returns the timed prompts' new tokens."""
    from prescient.arch import find_moe_layers
    from prescient.fingerprint import loaded_fingerprint
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
                generated.append(generate_ids(model, ids, new_tokens, job))
                rows = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
                rows["position"] = torch.arange(len(rows["token_id"]), dtype=torch.int32)
                columns.append(rows)
    finally:
        handle.remove()
    fingerprint = loaded_fingerprint(job.model_dir, model, layers, job.options.torch_dtype)
    manifest = TraceManifest(fingerprint, "bench-generation", "bench", top_t,
                             settings={"prompt_tokens": [len(p) for p, _ in sequences],
                                       "new_tokens": [n for _, n in sequences]})
    writer = TraceWriter(out, manifest)
    writer.add_shard({k: torch.cat([c[k] for c in columns]) for k in columns[0]}, sequences=len(columns))
    writer.finish()
    return generated[len(job.warmup):]


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
    """Load the job's model, warm up, time the prompts' decode; see
    `experiments.bench_runtime.bench.METHOD`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(job.threads)
    try:
        return _measure(job)
    finally:
        torch.set_num_threads(threads)


def _measure(job: Job) -> dict[str, Any]:
    began = time.perf_counter()
    with ExitStack() as stack:
        model, runtime, extra = load_job(job, stack)
        load_seconds = time.perf_counter() - began
        recorded = _record_routes(model, job, Path(job.trace_out)) if job.trace_out is not None else None
        release_freed_memory()
        load_peak, after_load = _status_mb("VmHWM"), _status_mb("VmRSS")
        reset = _reset_peak()
        for ids in job.warmup:
            generate_ids(model, ids, job.warmup_tokens, job)
        token_ids, decode_s, prefill_s, snapshots = [], 0.0, 0.0, []
        for ids in job.prompts:
            clock = _DecodeClock(runtime)
            token_ids.append(generate_ids(model, ids, job.new_tokens, job, clock))
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
