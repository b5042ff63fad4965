"""Decode-time latency of the SiDA hash function: milliseconds per `step` (one new token per
row, all L layers' experts predicted) after the attention window has filled. Wall-clock
median and p99, and the thread's CPU time per step (what a step costs on a core of its
own; wall time also counts waiting for a busy machine's cores).

    prescient bench-predictor-latency [--artifact NAME] [--n-layers 32 --n-experts 8]
        [--threads 1] [--batch-size 1] [--json runs/latency.json]

Without an artifact it times a randomly initialised hash function of the default sizes (the
weights do not change the cost).
"""

from __future__ import annotations

import logging
import platform
import statistics
import time
from dataclasses import asdict

import torch

from predictor.artifact import load_predictor
from predictor.base import PredictorMeta
from predictor.sida import SiDAHash, SiDAPredictor, SiDASizes
from prescient.atomic import write_json_atomic
from prescient.fingerprint import ModelFingerprint

log = logging.getLogger(__name__)


def measure_step_latency(
    artifact: str | None = None,
    sizes: SiDASizes | None = None,
    n_layers: int = 32,
    n_experts: int = 8,
    vocab_size: int = 32000,
    batch_size: int = 1,
    threads: int = 1,
    tokens: int = 2000,
    out: str | None = None,
) -> dict:
    """Median and p99 milliseconds per decoded token.

    Args:
        artifact: a saved "sida" predictor to time; default: random weights of `sizes`.
        sizes: hash-function sizes when no artifact is given.
        n_layers: MoE layers (no artifact).
        n_experts: experts per layer (no artifact).
        vocab_size: vocabulary (no artifact).
        batch_size: rows decoded together.
        threads: torch intra-op threads (the hash-building thread should not compete with inference).
        tokens: timed steps, after a warm-up that fills the attention window.
        out: JSON file for the result.
    """
    torch.set_num_threads(threads)
    if artifact:
        pred = load_predictor(artifact)
    else:
        sizes = sizes or SiDASizes()
        fp = ModelFingerprint("random", n_layers, n_experts, 2, vocab_size, "none")
        hash_fn = SiDAHash.from_embedding(torch.randn(vocab_size, 64), n_layers, n_experts, sizes)
        pred = SiDAPredictor(hash_fn, PredictorMeta("sida", fp, asdict(sizes)))
    state = pred.start(batch_size)
    ids = torch.randint(0, pred.meta.fingerprint.vocab_size, (pred.hash.sizes.attn_window + tokens, batch_size))
    for t in range(pred.hash.sizes.attn_window):
        pred.step(state, ids[t])
    times, cpu_start = [], time.thread_time()
    for t in range(pred.hash.sizes.attn_window, len(ids)):
        start = time.perf_counter()
        pred.step(state, ids[t])
        times.append((time.perf_counter() - start) * 1e3)
    cpu_ms = (time.thread_time() - cpu_start) * 1e3 / tokens
    times.sort()
    result = {
        "ms_per_token_median": statistics.median(times),
        "ms_per_token_p99": times[int(0.99 * (len(times) - 1))],
        "cpu_ms_per_token": cpu_ms,  # this thread's CPU time: what the step costs on a core of its own
        "batch_size": batch_size, "threads": threads, "tokens": tokens,
        "n_layers": pred.n_layers, "n_experts": pred.n_experts, "sizes": asdict(pred.hash.sizes),
        "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
    }
    log.info("step latency: median %.3f ms, p99 %.3f ms, CPU %.3f ms per token",
             result["ms_per_token_median"], result["ms_per_token_p99"], cpu_ms)
    if out:
        write_json_atomic(out, result)
    return result
