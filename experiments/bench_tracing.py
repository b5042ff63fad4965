"""Tracing throughput against a plain forward pass of the same batches.

    prescient bench-tracing --model DIR --json OUT [--dataset stdlib-code] [--tokens 16384]

Both sides run the same model over the same padded batches of the same windows. "plain" is
the model's forward and nothing else; "traced" is `training.tracing.trace_windows`: the same
forwards with router hooks, gathering rows and writing shards to a fresh trace folder.
Repetitions interleave plain and traced runs (the machine may be shared) and the medians
are reported, of wall time and of this process's CPU time (steadier on a shared machine).
"""

from __future__ import annotations

import logging
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from prescient.fingerprint import fingerprint_model
from prescient.loading import load_model, load_tokenizer
from prescient.traces import TraceManifest, TraceWriter
from training.corpora import load_corpus
from training.tracing import model_inputs, pad_batch, token_windows, trace_windows

log = logging.getLogger(__name__)


@torch.no_grad()
def plain_pass(model, windows: list[list[int]], pad_id: int, batch_size: int, shard_sequences: int) -> None:
    """The forwards `trace_windows` makes, batched the same way, without hooks."""
    for first in range(0, len(windows), shard_sequences):
        chunk = windows[first : first + shard_sequences]
        for start in range(0, len(chunk), batch_size):
            model(**model_inputs(model, *pad_batch(chunk[start : start + batch_size], pad_id)))


def traced_pass(model, layers, manifest: TraceManifest, windows: list[list[int]], pad_id: int, batch_size: int,
                shard_sequences: int, out: Path) -> int:
    """One full trace into the new folder `out`; returns the rows written."""
    writer = TraceWriter(out, manifest)
    trace_windows(model, layers, windows, writer, pad_id=pad_id, top_t=manifest.top_t,
                  batch_size=batch_size, shard_sequences=shard_sequences)
    writer.finish()
    return writer.manifest.n_tokens


def timed(fn, *args) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of `fn(*args)`."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn(*args)
    return time.perf_counter() - wall, time.process_time() - cpu


def bench_tracing(model_dir: str, dataset: str, split: str, tokens: int, seq_len: int, batch_size: int,
                  shard_sequences: int, top_t: int, repeats: int) -> dict:
    model, layers = load_model(model_dir, dtype=torch.float32)
    tokenizer = load_tokenizer(model_dir)
    fingerprint = fingerprint_model(model, layers)
    texts = load_corpus(dataset, split)["text"]
    windows = list(token_windows(tokenizer, texts, seq_len, tokens))
    n_tokens = sum(len(w) for w in windows)
    manifest = TraceManifest(fingerprint, dataset, split, min(top_t, fingerprint.n_experts))
    args = (windows, tokenizer.pad_token_id, batch_size, shard_sequences)
    times: dict[str, list[tuple[float, float]]] = {"plain": [], "traced": []}
    with tempfile.TemporaryDirectory() as tmp:
        rows = traced_pass(model, layers, manifest, *args, Path(tmp) / "warm-up")
        if rows != n_tokens:
            raise RuntimeError(f"the trace holds {rows} rows for {n_tokens} tokens")
        plain_pass(model, *args)
        for rep in range(repeats):
            times["plain"].append(timed(plain_pass, model, *args))
            times["traced"].append(timed(traced_pass, model, layers, manifest, *args, Path(tmp) / f"run-{rep}"))
            log.info("repeat %d: plain %.3f s (cpu %.3f s), traced %.3f s (cpu %.3f s)", rep,
                     *times["plain"][-1], *times["traced"][-1])
    wall = {k: statistics.median(t[0] for t in v) for k, v in times.items()}
    cpu = {k: statistics.median(t[1] for t in v) for k, v in times.items()}
    return {
        "model": str(model_dir),
        "fingerprint": str(fingerprint),
        "dataset": f"{dataset}/{split}",
        "tokens": n_tokens,
        "settings": {"seq_len": seq_len, "batch_size": batch_size, "shard_sequences": shard_sequences,
                     "top_t": manifest.top_t, "repeats": repeats},
        "plain_tokens_per_s": n_tokens / wall["plain"],
        "traced_tokens_per_s": n_tokens / wall["traced"],
        "overhead_pct": 100 * (wall["traced"] / wall["plain"] - 1),
        # CPU seconds of this process: steadier than wall time when other jobs share the machine
        "cpu_overhead_pct": 100 * (cpu["traced"] / cpu["plain"] - 1),
        "runs_s": {k: [{"wall": w, "cpu": c} for w, c in v] for k, v in times.items()},
        "machine": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
                    "load_avg_1m": os.getloadavg()[0]},
    }
