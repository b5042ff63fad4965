"""Forecast heads of the SiDA hash function: causal and incremental like its own head, saved
with their horizon, and artifacts without heads loading and working exactly as before."""

import dataclasses

import pytest
import torch

from predictor import (
    ForecastHorizonError,
    FrequencyPredictor,
    PredictorError,
    PredictorMeta,
    SiDAHash,
    SiDAPredictor,
    SiDASizes,
    load_predictor,
    save_predictor,
)
from predictor.forecast import chance_selected, chances_of_use, discount_weights
from prescient.traces import load_trace

SIZES = SiDASizes(compress_dim=8, hidden_dim=12, attn_window=4)


def sida(fingerprint, horizon: int, hparams: dict | None = None) -> SiDAPredictor:
    torch.manual_seed(0)
    hash_fn = SiDAHash.from_embedding(torch.randn(fingerprint.vocab_size, 16), fingerprint.n_moe_layers,
                                      fingerprint.n_experts, SIZES, horizon)
    with torch.no_grad():  # trained-looking heads: at init every forecast is near zero
        for p in hash_fn.parameters():
            p.mul_(3)
    hparams = {**dataclasses.asdict(SIZES), "horizon": horizon} if hparams is None else hparams
    return SiDAPredictor(hash_fn, PredictorMeta("sida", fingerprint, hparams))


def test_stepwise_forecasts_equal_the_batched_form_and_never_see_the_future(tiny_fingerprint):
    pred = sida(tiny_fingerprint, horizon=2)
    assert pred.horizon == 2
    ids = torch.randint(0, tiny_fingerprint.vocab_size, (3, 10))
    scores, forecasts = pred.predict_with_forecasts(ids)
    assert forecasts.shape == (3, 10, 2, tiny_fingerprint.n_moe_layers, tiny_fingerprint.n_experts)
    torch.testing.assert_close(scores, pred.predict(ids))  # the current token's head is untouched
    state = pred.start(3)
    for t in range(10):
        pred.step(state, ids[:, t])
        torch.testing.assert_close(pred.forecast(state), forecasts[:, t], atol=1e-5, rtol=1e-5)
    _, prefix = pred.predict_with_forecasts(ids[:, :4])
    torch.testing.assert_close(prefix, forecasts[:, :4], atol=1e-5, rtol=1e-5)  # causal
    assert not torch.allclose(forecasts[:, :, 0], forecasts[:, :, 1])  # one head per horizon


def test_a_shorter_horizon_is_a_slice_and_a_longer_one_says_what_to_train(tiny_fingerprint):
    pred = sida(tiny_fingerprint, horizon=2)
    ids = torch.randint(0, tiny_fingerprint.vocab_size, (2, 5))
    _, both = pred.predict_with_forecasts(ids)
    _, first = pred.predict_with_forecasts(ids, horizon=1)
    torch.testing.assert_close(first, both[:, :, :1])
    state = pred.start(2)
    with pytest.raises(PredictorError, match="call step"):
        pred.forecast(state)
    pred.step(state, ids[:, 0])
    assert pred.forecast(state, horizon=1).shape[1] == 1
    with pytest.raises(ForecastHorizonError, match=r"forecasts 1\.\.2 tokens ahead, not 3.*--model.horizon 3"):
        pred.forecast(state, horizon=3)
    with pytest.raises(ForecastHorizonError, match="--model.horizon 4"):
        pred.predict_with_forecasts(ids, horizon=4)


def test_forecast_heads_round_trip_with_their_horizon(tmp_path, tiny_fingerprint):
    pred = sida(tiny_fingerprint, horizon=3)
    save_predictor(pred, tmp_path / "hash")
    loaded = load_predictor(tmp_path / "hash", fingerprint=tiny_fingerprint)
    assert loaded.horizon == 3 and loaded.meta.hparams["horizon"] == 3
    ids = torch.randint(0, tiny_fingerprint.vocab_size, (2, 6))
    for got, expected in zip(loaded.predict_with_forecasts(ids), pred.predict_with_forecasts(ids)):
        torch.testing.assert_close(got, expected)


def test_an_artifact_without_heads_loads_and_works_as_before(tmp_path, tiny_fingerprint):
    """An artifact written before forecast heads: hparams are the sizes alone, no head tensors."""
    old = sida(tiny_fingerprint, horizon=0, hparams=dataclasses.asdict(SIZES))
    save_predictor(old, tmp_path / "old")
    assert not any(name.startswith("forecast") for name in old.tensors())
    loaded = load_predictor(tmp_path / "old", fingerprint=tiny_fingerprint)
    assert loaded.horizon == 0 and loaded.meta.hparams == dataclasses.asdict(SIZES)
    ids = torch.randint(0, tiny_fingerprint.vocab_size, (2, 7))
    torch.testing.assert_close(loaded.predict(ids), old.predict(ids))
    state = loaded.start(2)
    steps = torch.stack([loaded.step(state, ids[:, t]) for t in range(7)], dim=1)
    torch.testing.assert_close(steps, old.predict(ids), atol=1e-5, rtol=1e-5)
    with pytest.raises(ForecastHorizonError, match="has no forecasts; train one with --model.horizon 1"):
        loaded.forecast(state)
    with pytest.raises(ForecastHorizonError, match="--model.horizon 2"):
        loaded.predict_with_forecasts(ids, horizon=2)


def test_other_predictors_have_no_forecasts(synthetic_trace):
    pred = FrequencyPredictor.from_trace(load_trace(synthetic_trace))
    assert pred.horizon == 0
    with pytest.raises(ForecastHorizonError, match="'frequency' predictor has no forecasts"):
        pred.forecast(pred.start(1))
    with pytest.raises(PredictorError, match="--model.horizon"):
        pred.predict_with_forecasts(torch.zeros(1, 3, dtype=torch.long))


def test_forecast_heads_need_the_causal_variant():
    with pytest.raises(PredictorError, match="causal variant"):
        SiDAHash.from_embedding(torch.randn(10, 4), 2, 4, dataclasses.replace(SIZES, bidirectional=True), horizon=2)


@pytest.mark.parametrize("horizon", [1, 3])
def test_the_compiled_chances_of_use_equal_the_torch_formula(tiny_fingerprint, horizon):
    """What the runtime asks once a token (`chances_of_use`, compiled) is the torch formula's
    chances of use soon and later and the next token's chances of selection, row by row; a
    predictor that turns scores into chances its own way keeps its way."""
    pred = sida(tiny_fingerprint, horizon=horizon)
    state = pred.start(2)
    for token in ([1, 5], [7, 2], [3, 3]):
        scores = pred.step(state, torch.tensor(token))
        ahead = pred.forecast(state)
        want = (*chances_of_use(scores, ahead, 2), chance_selected(ahead[:, 0], 2))
        got = pred.chances_of_use(state, scores, 2)
        assert all(g.shape == (2, *scores.shape[1:]) and torch.allclose(g, w, atol=1e-6) for g, w in zip(got, want))
    pred.chance_selected = lambda s, top_k: torch.ones_like(s)  # certain of every expert
    soon, later, next_token = pred.chances_of_use(state, scores, 2)
    assert torch.allclose(soon, torch.ones_like(soon)) and torch.allclose(next_token, torch.ones_like(next_token))
    assert torch.allclose(later, 1 - discount_weights(horizon + 1)[0].expand_as(later))


def test_a_predictor_ranking_by_the_default_chances_takes_the_compiled_call(tiny_fingerprint, monkeypatch):
    """The runtime's once-a-token call goes through the compiled kernel, not the torch formula."""
    import predictor.base as base

    pred = sida(tiny_fingerprint, horizon=2)
    state = pred.start(1)
    scores = pred.step(state, torch.tensor([1]))
    calls = []
    monkeypatch.setattr(base, "chances_of_use_compiled", lambda *a: calls.append(a) or (scores,) * 3)
    pred.chances_of_use(state, scores, 2)
    assert len(calls) == 1
