"""The ablation and latency scripts run and write what they promise."""

import json

from predictor.sida import SiDASizes
from training.predictor_ablation import run_ablation
from training.predictor_latency import measure_step_latency

TINY = SiDASizes(compress_dim=8, hidden_dim=16, attn_window=8)


def test_ablation_writes_every_variant_and_the_baselines(tmp_path, synthetic_trace):
    out = tmp_path / "ablation.json"
    run_ablation(str(synthetic_trace), str(out), variants=["paper", "bce"], max_steps=6, val_every=3,
                 sizes=TINY, window=12, batch_size=8)
    result = json.loads(out.read_text())
    assert set(result["variants"]) == {"paper", "bce"}
    assert result["variants"]["bce"]["loss"]["topk_bce_weight"] == 1.0
    assert 0 <= result["variants"]["paper"]["best"]["val/recall_at_k"] <= 1
    token_table = result["baselines"]["token-table"]
    assert token_table["recall_at_k"] > result["baselines"]["frequency"]["recall_at_k"]


def test_latency_measures_decode_steps(tmp_path):
    result = measure_step_latency(sizes=TINY, n_layers=2, n_experts=4, vocab_size=50, tokens=20,
                                  out=str(tmp_path / "latency.json"))
    assert 0 < result["ms_per_token_median"] <= result["ms_per_token_p99"]
    assert result["module_ms_per_token_median"] > 0 and result["cold_mb"] == 0  # the torch step beside it
    assert json.loads((tmp_path / "latency.json").read_text())["n_layers"] == 2
    cold = measure_step_latency(sizes=TINY, n_layers=2, n_experts=4, vocab_size=50, tokens=20, cold_mb=4)
    assert cold["cold_mb"] == 4 and cold["ms_per_token_median"] > 0
