"""Learned eviction in the serving runtime: the hash-building thread's tables carry the forecast
heads' chances of use, the cache ranks by them, and generation stays exact; hide-only prefetch
(a link timing) issues only the copies that can end before their layer runs."""

import dataclasses

import numpy as np
import pytest
import torch

from cache.timing import LinkTiming
from offload_runtime.engine.loader import load_offloaded
from predictor import ForecastHorizonError, PredictorError, PredictorMeta, SiDAHash, SiDAPredictor, SiDASizes
from prescient.fingerprint import fingerprint_model
from prescient.loading import load_model
from tests.runtime.test_offloaded_generate import encode, generate, save_tiny_predictor, wait_for_tables

SIZES = SiDASizes(compress_dim=8, hidden_dim=12, attn_window=4)


def forecasting_sida(path, horizon: int = 2) -> SiDAPredictor:
    model, layers = load_model(path, dtype=torch.float32)
    fingerprint = fingerprint_model(model, layers)
    torch.manual_seed(0)
    hash_fn = SiDAHash.from_embedding(model.get_input_embeddings().weight.detach(), fingerprint.n_moe_layers,
                                      fingerprint.n_experts, SIZES, horizon)
    return SiDAPredictor(hash_fn, PredictorMeta("sida", fingerprint, {**dataclasses.asdict(SIZES), "horizon": horizon}))


@pytest.mark.parametrize("policy", ["learned", "learned-belady"])
def test_learned_eviction_is_exact_and_ranks_by_the_forecasts(tiny_moe_dir, policy):
    path = tiny_moe_dir("mixtral")
    inputs = encode(path, encoder_decoder=False)
    plain, _ = load_model(path, dtype=torch.float32)
    want = generate(plain, inputs, new_tokens=6)
    model = load_offloaded(path, predictor=forecasting_sida(path), policy=policy, budget=0.5)
    wait_for_tables(model)
    runtime = model.offload_runtime
    fed = []
    on_forecast = runtime.cache.on_forecast
    runtime.cache.on_forecast = lambda chances: (fed.append(np.array(chances)), on_forecast(chances))
    with runtime:
        out = generate(model, inputs, new_tokens=6)
    assert torch.equal(out, want)
    assert len(fed) == runtime.stats().tables_on_time == 6  # one forecast per forward, from its table
    assert all(f.shape == (len(runtime.layers), runtime.n_experts) and 0 <= f.min() and f.max() <= 1 for f in fed)
    assert runtime.cache.state.outside.max() > 0  # the forecasts reached the ranks


def test_learned_eviction_needs_a_predictor_with_forecast_heads(tiny_moe_dir, tmp_path):
    path = tiny_moe_dir("mixtral")
    with pytest.raises(PredictorError, match="--model.horizon"):
        load_offloaded(path, policy="learned", budget=0.5)
    with pytest.raises(ForecastHorizonError, match="--model.horizon"):
        load_offloaded(path, predictor=save_tiny_predictor("frequency", path, tmp_path), policy="learned", budget=0.5)


@pytest.mark.parametrize(("compute_s", "transfer_s", "prefetches"), [(1e-3, 1.0, False), (1.0, 1e-3, True)])
def test_hide_only_prefetch_issues_only_what_the_link_can_hide(tiny_moe_dir, compute_s, transfer_s, prefetches):
    path = tiny_moe_dir("mixtral")
    inputs = encode(path, encoder_decoder=False)
    plain, _ = load_model(path, dtype=torch.float32)
    want = generate(plain, inputs, new_tokens=6)
    link = LinkTiming(compute_s, 100.0, 100.0 / transfer_s)  # a copy takes transfer_s, a layer computes compute_s
    model = load_offloaded(path, predictor=forecasting_sida(path), policy="lru", budget=0.5, link_timing=link)
    wait_for_tables(model)
    with model.offload_runtime as runtime:
        out = generate(model, inputs, new_tokens=6)
        stats = runtime.stats()
    assert torch.equal(out, want)
    assert stats.tables_on_time > 0 and (stats.prefetch_inserts > 0) == prefetches
