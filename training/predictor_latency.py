"""Decode-time latency of the SiDA hash function: milliseconds per `step` (one new token per
row, all L layers' experts predicted) after the attention window has filled. Wall-clock
median and p99, and the thread's CPU time per step (what a step costs on a core of its
own; wall time also counts waiting for a busy machine's cores). `step` is the predictor's (for
SiDA's causal variant the fused compiled step, `predictor.sida_decode`); `module_ms_per_token_median`
times the hash function's own torch step and forecasts beside it. With `cold_mb`, each step
follows a matrix-vector product over that many MB of float32 weights, as the runtime's inline step
follows the experts' (the CPU's caches are cold from them).

    prescient bench-predictor-latency [--artifact NAME] [--n-layers 32 --n-experts 8]
        [--threads 1] [--batch-size 1] [--cold-mb 0] [--json runs/latency.json]

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
    cold_mb: int = 0,
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
        cold_mb: MB of weights streamed (a matrix-vector product) before each timed step; 0: none.
    """
    torch.set_num_threads(threads)
    if artifact:
        pred = load_predictor(artifact)
    else:
        sizes = sizes or SiDASizes()
        fp = ModelFingerprint("random", n_layers, n_experts, 2, vocab_size, "none")
        hash_fn = SiDAHash.from_embedding(torch.randn(vocab_size, 64), n_layers, n_experts, sizes)
        pred = SiDAPredictor(hash_fn, PredictorMeta("sida", fp, asdict(sizes)))
    ids = torch.randint(0, pred.meta.fingerprint.vocab_size, (pred.hash.sizes.attn_window + tokens, batch_size))
    weights = torch.randn(cold_mb * 2**18) if cold_mb else None  # cold_mb MB of float32
    times, cpu_ms = _timed_steps(pred.step, pred.start(batch_size), ids, pred.hash.sizes.attn_window, weights)

    def module_step(state, token_ids):  # the hash function's torch step and, with heads, its forecasts
        pred.hash.step(state, token_ids)
        return pred.hash.forecasts(state.feature) if pred.hash.forecast_head is not None else None

    with torch.inference_mode():
        module_times, _ = _timed_steps(module_step, pred.hash.start(batch_size), ids, pred.hash.sizes.attn_window,
                                       weights)
    result = {
        "ms_per_token_median": statistics.median(times),
        "ms_per_token_p99": times[int(0.99 * (len(times) - 1))],
        "cpu_ms_per_token": cpu_ms,  # this thread's CPU time: what the step costs on a core of its own
        "module_ms_per_token_median": statistics.median(module_times),
        "cold_mb": cold_mb,
        "batch_size": batch_size, "threads": threads, "tokens": tokens,
        "n_layers": pred.n_layers, "n_experts": pred.n_experts, "sizes": asdict(pred.hash.sizes),
        "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
    }
    log.info("step latency: median %.3f ms, p99 %.3f ms, CPU %.3f ms per token",
             result["ms_per_token_median"], result["ms_per_token_p99"], cpu_ms)
    if out:
        write_json_atomic(out, result)
    return result


def _timed_steps(step, state, ids: torch.Tensor, warm_up: int, weights: torch.Tensor | None) -> tuple[list, float]:
    """Milliseconds of each `step` after the first `warm_up` ids (sorted), and the CPU ms per step;
    each after a matrix-vector product over `weights` (1024 columns) where given."""
    for t in range(warm_up):
        step(state, ids[t])
    times, cpu = [], 0.0
    for t in range(warm_up, len(ids)):
        if weights is not None:
            weights.view(-1, 1024).mv(weights[:1024])
        start, cpu_start = time.perf_counter(), time.thread_time()
        step(state, ids[t])
        times.append((time.perf_counter() - start) * 1e3)
        cpu += time.thread_time() - cpu_start
    return sorted(times), cpu * 1e3 / (len(ids) - warm_up)
