"""Klotski's planner, stage 1: the times of one batch's attention and gate, of an expert over m
tokens, and of one expert's copy, measured on this machine with the model itself.

Each time is the median of `repeats` runs of the model's own submodules (the decoder stack's
attention half at the workload's context, the first MoE layer's router, its experts module with
every token sent to one expert), after one warm-up run. An expert's compute is fitted as
fixed + per_token·m by least squares over a few token counts; its copy is its bytes over the
link's measured bandwidth (the store's reads, `experiments.bench_batch.store_read_bandwidth`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from offload_runtime.cgopipe.decoder_stack import DecoderStack
from offload_runtime.planning.klotski import KlotskiTimes
from prescient.arch import MoELayer

EXPERT_TOKENS = (1, 4, 16, 64)


def _median_seconds(run: Callable[[], object], repeats: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.no_grad()
def measure_klotski_times(model: nn.Module, layers: list[MoELayer], batch_size: int, context: int,
                          expert_bytes: float, link_bandwidth: float, repeats: int = 5) -> KlotskiTimes:
    """`model` with every weight resident (the plain model), `layers` its MoE layers; a decode
    step's attention for `batch_size` requests with `context` tokens of KV cache."""
    stack = DecoderStack(model, attention_device=None)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch_size, context + 1), generator=generator)
    mask = torch.ones_like(ids)
    cache = stack.new_cache()
    hidden, inputs = stack.embed(ids[:, :context], mask[:, :context], cache)
    stack.attention_half(0, hidden, inputs)  # fills layer 0's KV cache with the context
    step, step_inputs = stack.embed(ids[:, context:], mask, cache)
    def attention() -> None:
        stack.attention_half(0, step, step_inputs)
        cache.crop(-1)  # every run sees the same context

    layer = layers[0]
    normed = stack.layers[0].post_attention_layernorm(step).reshape(batch_size, -1)
    gate = _median_seconds(lambda: layer.router(normed), repeats)
    expert_times = []
    for tokens in EXPERT_TOKENS:
        x = torch.randn(tokens, normed.shape[-1], generator=generator)
        chosen, weights = torch.zeros(tokens, 1, dtype=torch.long), torch.ones(tokens, 1)
        expert_times.append(_median_seconds(lambda x=x, c=chosen, w=weights: layer.experts(x, c, w), repeats))
    per_token, fixed = np.polyfit(EXPERT_TOKENS, expert_times, 1)
    return KlotskiTimes(attention=_median_seconds(attention, repeats), gate=gate,
                        expert_fixed=max(float(fixed), 0.0), expert_per_token=max(float(per_token), 0.0),
                        io_expert=expert_bytes / link_bandwidth)
