"""The LM-head forecasting ceiling: its figures are recalls and shares, they grow with m, the
full vocabulary finds every next token, and a forecaster's own recall and its blends are reported."""

from __future__ import annotations

import pytest

from experiments import next_token_ceiling
from tests.conftest import random_sida
from training.tracing import trace_model


def test_ceiling_figures_are_shares_growing_with_m(tiny_moe_dir, text_corpus, tmp_path, monkeypatch):
    model = tiny_moe_dir("mixtral")
    trace = trace_model(model, f"json:{text_corpus}", tmp_path / "trace", split="train", max_tokens=200, top_t=4,
                        seq_len=16, batch_size=4)
    monkeypatch.setattr(next_token_ceiling, "TOP_M", (1, 2, 4, 320))  # 320: the tiny tokenizer's whole vocabulary
    sida = random_sida(model, tmp_path, horizon=2)
    result = next_token_ceiling.measure(model, trace, f"json:{text_corpus}", windows=4, seq_len=32, split="train",
                                        forecaster=sida)
    assert result["positions"] == 4 * 31
    rows = [result["top_m"][m] for m in (1, 2, 4, 320)]
    shares = [row["next_in_top_m"] for row in rows]
    assert shares == sorted(shares) and shares[-1] == pytest.approx(1.0)
    for row in rows:
        assert 0 <= row["lm_top_m_table_recall_at_k"] <= row["lm_top_m_table_recall_at_2k"] <= 1
    assert 0 < result["true_next_table_recall_at_k"] <= result["true_next_table_recall_at_2k"] <= 1
    assert 0 < result["forecaster_recall_at_k"] <= result["forecaster_recall_at_2k"] <= 1
    assert set(result["blend"]) == set(next_token_ceiling.BLEND_WEIGHTS)
    assert all(0 < b["recall_at_k"] <= b["recall_at_2k"] <= 1 for b in result["blend"].values())
