"""The fused decode step (`predictor.sida_decode`) computes what the module's own step computes:
the same logits and forecasts within float32 rounding, for any LSTM depth, past the attention
window (its ring of outputs), row by row in a batch."""

import dataclasses

import pytest
import torch

from predictor import PredictorMeta, SiDAHash, SiDAPredictor, SiDASizes, sida_decode


@pytest.mark.parametrize("layers, horizon", [(1, 0), (2, 2), (3, 1)])
def test_the_fused_step_equals_the_modules_step(tiny_fingerprint, layers, horizon):
    torch.manual_seed(layers)
    sizes = SiDASizes(compress_dim=8, hidden_dim=12, lstm_layers=layers, attn_window=5)
    hash_fn = SiDAHash.from_embedding(torch.randn(tiny_fingerprint.vocab_size, 16), tiny_fingerprint.n_moe_layers,
                                      tiny_fingerprint.n_experts, sizes, horizon)
    with torch.no_grad():  # spread-out scores: sparsemax keeps several weights, not one
        for p in hash_fn.parameters():
            p.mul_(3)
    pred = SiDAPredictor(hash_fn, PredictorMeta("sida", tiny_fingerprint, {**dataclasses.asdict(sizes),
                                                                            "horizon": horizon}))
    fused, module = pred.start(3), pred.hash.start(3)
    assert isinstance(fused, sida_decode.DecodeState)
    ids = torch.randint(0, tiny_fingerprint.vocab_size, (3, 12))
    for t in range(ids.shape[1]):  # 12 tokens through a window of 5
        torch.testing.assert_close(pred.step(fused, ids[:, t]), pred.hash.step(module, ids[:, t]), atol=1e-5, rtol=1e-5)
        if horizon:
            torch.testing.assert_close(pred.forecast(fused), pred.hash.forecasts(module.feature), atol=1e-5, rtol=1e-5)


def test_a_token_outside_the_vocabulary_is_refused_not_read_out_of_bounds(tiny_fingerprint):
    sizes = SiDASizes(compress_dim=8, hidden_dim=12, attn_window=5)
    hash_fn = SiDAHash.from_embedding(torch.randn(tiny_fingerprint.vocab_size, 16), tiny_fingerprint.n_moe_layers,
                                      tiny_fingerprint.n_experts, sizes)
    pred = SiDAPredictor(hash_fn, PredictorMeta("sida", tiny_fingerprint, {**dataclasses.asdict(sizes), "horizon": 0}))
    state = pred.start(1)
    with pytest.raises(IndexError, match="outside the predictor's vocabulary"):
        pred.step(state, torch.tensor([tiny_fingerprint.vocab_size]))
    with pytest.raises(IndexError, match="outside"):
        pred.step(state, torch.tensor([-1]))
