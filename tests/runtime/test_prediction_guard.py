"""The prediction guard: with forecasts that are wrong, the runtime stops acting on them and loads
no more experts than LRU would (but for the window that judged them); with forecasts that are
right, it keeps their gain; either way it computes the plain model's tokens."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from offload_runtime.engine import prediction_guard
from offload_runtime.engine.loader import load_offloaded
from prescient.loading import load_model
from prescient.model_dir import load_tokenizer
from tests.runtime.test_learned_eviction_runtime import forecasting_sida

NEW_TOKENS = 96
PROMPT = "def read_config(path):\n    with open(path) as f:"


def _run(path, inputs, predictor=None, **options):
    """(generated ids, runtime statistics, keys accessed in order) of one greedy generation."""
    model = load_offloaded(path, predictor, budget=0.25, **options)
    accessed = Counter()
    access_many = model.offload_runtime.cache.access_many

    def counting(keys, pin=False):
        accessed.update(keys)
        return access_many(keys, pin=pin)

    model.offload_runtime.cache.access_many = counting
    with model.offload_runtime as runtime, torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        runtime.builder and runtime.builder.wait(runtime.step, 5.0)
        return out, runtime.stats(), accessed


def _steering(predictor, favoured: torch.Tensor):
    """`predictor` made to predict, for every token and every forecast, the experts in `favoured`
    ([L, E] of 0/1) with certainty."""
    logits = favoured.float() * 20 - 10  # sigmoid/softmax: near 1 where favoured, near 0 elsewhere
    step, forecast = predictor.step, predictor.forecast
    predictor.step = lambda state, ids: step(state, ids) * 0 + logits
    predictor.forecast = lambda state, horizon=None: forecast(state, horizon) * 0 + logits
    return predictor


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def case(tiny_moe_dir, request):
    path, dtype = tiny_moe_dir("mixtral"), request.param
    inputs = dict(load_tokenizer(path)(PROMPT, return_tensors="pt"))
    with torch.inference_mode():
        want = load_model(path, dtype=getattr(torch, dtype))[0].generate(
            **inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    _, lru, accessed = _run(path, inputs, policy="lru", dtype=dtype)
    return path, inputs, want, lru, accessed, dtype


def _least_used(accessed: Counter, n_layers: int, n_experts: int, count: int) -> torch.Tensor:
    favoured = torch.zeros(n_layers, n_experts)
    for layer in range(n_layers):
        for expert in sorted(range(n_experts), key=lambda e: accessed[(layer, e)])[:count]:
            favoured[layer, expert] = 1
    return favoured


def test_wrong_forecasts_are_dropped_and_the_run_loads_no_more_than_lru(case):
    path, inputs, want, lru, accessed, dtype = case
    n_layers, n_experts = len({key[0] for key in accessed}), 1 + max(key[1] for key in accessed)
    wrong = _least_used(accessed, n_layers, n_experts, 2)
    runs = {}
    for guarded in (False, True):
        predictor = _steering(forecasting_sida(path), wrong)
        out, stats, _ = _run(path, inputs, predictor, policy="learned-belady", prediction_guard=guarded,
                                dtype=dtype)
        assert torch.equal(out, want)
        runs[guarded] = stats
    assert runs[False].loads > 1.2 * lru.loads  # acting on the wrong forecasts loses
    assert runs[True].prediction_lost_windows >= 1 and runs[True].prediction_paused_forwards > NEW_TOKENS / 2
    # what it lost is what the moving sum needed to judge the forecasts: a few hits, not the unguarded
    # run's (here 0.05 against LRU's 0.22)
    assert runs[True].hit_rate >= lru.hit_rate - 0.03 > runs[False].hit_rate + 0.1
    assert runs[True].loads <= lru.loads + 4 * prediction_guard.WINDOW


def test_right_forecasts_keep_their_gain(case):
    """Forecasts of the most-used experts: acting on them beats LRU, and the guard keeps the gain."""
    path, inputs, want, lru, accessed, dtype = case
    n_layers, n_experts = len({key[0] for key in accessed}), 1 + max(key[1] for key in accessed)
    right = _least_used(Counter({k: -v for k, v in accessed.items()}), n_layers, n_experts, 2)  # the most used
    out, stats, _ = _run(path, inputs, _steering(forecasting_sida(path), right), policy="learned-belady",
                              dtype=dtype)
    assert torch.equal(out, want)
    assert stats.hit_rate > lru.hit_rate and stats.loads <= lru.loads
