"""The forecasting ceilings of the model's own state: its figures are recalls and shares, they grow
with m, the full vocabulary finds every next token, the in-context picks are the model's own
routing, and a forecaster's own recall, its blends and the state probes are reported."""

from __future__ import annotations

import pytest
import torch

from experiments import next_token_ceiling
from prescient.loading import load_model
from tests.conftest import random_sida
from training.router_hooks import RouterRecorder
from training.tracing import trace_model


def test_ceiling_figures_are_shares_growing_with_m(tiny_moe_dir, text_corpus, tmp_path, monkeypatch):
    model = tiny_moe_dir("mixtral")
    trace = trace_model(model, f"json:{text_corpus}", tmp_path / "trace", split="train", max_tokens=200, top_t=4,
                        seq_len=16, batch_size=4)
    monkeypatch.setattr(next_token_ceiling, "TOP_M", (1, 2, 4, 320))  # 320: the tiny tokenizer's whole vocabulary
    monkeypatch.setattr(next_token_ceiling, "PROBE_EPOCHS", 2)
    sida = random_sida(model, tmp_path, horizon=2)
    result = next_token_ceiling.measure(model, trace, f"json:{text_corpus}", windows=4, seq_len=32, split="train",
                                        forecaster=sida, in_context=True, probe_windows=4)
    assert result["positions"] == 4 * 31
    rows = [result["top_m"][m] for m in (1, 2, 4, 320)]
    shares = [row["next_in_top_m"] for row in rows]
    assert shares == sorted(shares) and shares[-1] == pytest.approx(1.0)
    for row in rows:
        assert 0 <= row["lm_top_m_table_recall_at_k"] <= row["lm_top_m_table_recall_at_2k"] <= 1
        assert 0 <= row["lm_top_m_in_context_recall_at_k"] <= row["lm_top_m_in_context_recall_at_2k"] <= 1
        assert 0 < row["in_context_blend_recall_at_2k"] <= 1
    assert 0 < result["true_next_table_recall_at_k"] <= result["true_next_table_recall_at_2k"] <= 1
    assert 0 < result["forecaster_recall_at_k"] <= result["forecaster_recall_at_2k"] <= 1
    assert set(result["blend"]) == set(next_token_ceiling.BLEND_WEIGHTS)
    assert all(0 < b["recall_at_k"] <= b["recall_at_2k"] <= 1 for b in result["blend"].values())
    probes = result["state_probes"]
    assert probes["positions"] == 4 * 30 and set(probes["inputs"]) == set(next_token_ceiling.PROBE_INPUTS)
    for row in probes["inputs"].values():
        assert 0 < row["recall_at_k"] <= row["recall_at_2k"] <= 1 and 0 < row["blend_recall_at_2k"] <= 1


def test_in_context_picks_of_the_true_next_token_are_the_models_own_routing(tiny_moe_dir, text_corpus):
    model, layers = load_model(tiny_moe_dir("mixtral"), dtype=torch.float32)
    window = torch.randint(0, model.config.vocab_size, (24,), generator=torch.Generator().manual_seed(0))
    recorder = RouterRecorder(layers)
    with torch.no_grad(), recorder.recording():
        model(window[None])
        _, routed = recorder.stacked(1, len(window))
        other = (window[1:] + 1) % model.config.vocab_size
        picks = next_token_ceiling.in_context_picks(model, recorder, window, torch.stack([window[1:], other], 1))
    assert picks.shape == (len(window) - 1, 2, len(layers), layers[0].top_k)
    assert torch.equal(picks[:, 0].sort(-1).values, routed[0, 1:].sort(-1).values)
    assert not torch.equal(picks[:, 1], picks[:, 0])  # another candidate routes differently somewhere
