"""experiments.forecast_eval: per-horizon recall of SiDA's forecasts beside training-free
forecasters, on hand-made traces whose answers can be counted by hand."""

import dataclasses
import json

import pytest
import torch

from experiments.forecast_eval import (
    ForecastEvalError,
    forecast_report,
    future_rows,
    recency_scores,
    write_forecast_eval,
)
from predictor import ForecastHorizonError, PredictorMeta, SiDAHash, SiDAPredictor, SiDASizes, save_predictor
from prescient.traces import load_trace

# two sequences; layer 0 cycles through expert pairs, so token t+1's experts are never token t's
SEQUENCES = [[1, 2, 3, 1, 2, 3], [3, 1, 2]]
PAIRS = {1: [0, 1], 2: [2, 3], 3: [4, 5]}


def topk_for(sequences: list[list[int]], layers: int = 3) -> torch.Tensor:
    return torch.tensor([[PAIRS[t]] * layers for s in sequences for t in s])


@pytest.fixture
def hand_trace(tmp_path, make_hand_trace):
    return load_trace(make_hand_trace(tmp_path / "hand", SEQUENCES, topk_for(SEQUENCES)))


def test_targets_stay_inside_their_sequence(hand_trace):
    source, target = future_rows(hand_trace, 2)
    assert source.tolist() == [0, 1, 2, 3, 6] and target.tolist() == [2, 3, 4, 5, 8]


def test_recency_counts_the_sequence_so_far_and_stops_at_its_start(hand_trace):
    tie_break = torch.zeros(3, 8)
    scores = recency_scores(hand_trace, 0.5, tie_break)
    assert scores[3, 0, :6].tolist() == [1.125, 1.125, 0.25, 0.25, 0.5, 0.5]  # tokens 1, 3, 2, 1 (0..3 back)
    assert scores[6, 0, :6].tolist() == [0.0, 0.0, 0.0, 0.0, 1.0, 1.0]  # a new sequence forgets the last one
    assert torch.equal(recency_scores(hand_trace, 0.0, tie_break)[:, 0, :6].nonzero()[:, 1] // 2,
                       torch.tensor([t - 1 for s in SEQUENCES for t in s]).repeat_interleave(2))


def test_report_recalls_by_hand(hand_trace):
    report = forecast_report(hand_trace, hand_trace, horizon=3, decay_grid=(0.0, 1.0))
    found = report["forecasters"]
    # the next pair never repeats the current one: the token table and recency find none of it
    assert found["token"]["horizons"]["1"]["recall_at_k"] == 0.0
    assert found["recency"]["horizons"]["1"]["recall_at_k"] == 0.0
    # three tokens ahead, the cycle comes back: the token of t is the token of t+3
    assert found["token"]["horizons"]["3"] == {"recall_at_k": 1.0, "recall_at_2k": 1.0, "n_tokens": 3}
    # a bigram table of the trace itself knows the cycle
    assert found["next-token"]["horizons"]["1"]["recall_at_k"] == 1.0
    assert found["recency"]["training_free"] and not found["next-token"]["training_free"]
    assert report["target"]["best_training_free"] in ("token", "freq", "recency", "recency-decay")
    assert "sida" not in found and "met" not in report["target"]


def sida_artifact(path, fingerprint, horizon: int):
    torch.manual_seed(0)
    sizes = SiDASizes(compress_dim=8, hidden_dim=12, attn_window=4)
    hash_fn = SiDAHash.from_embedding(torch.randn(fingerprint.vocab_size, 16), fingerprint.n_moe_layers,
                                      fingerprint.n_experts, sizes, horizon)
    meta = PredictorMeta("sida", fingerprint, {**dataclasses.asdict(sizes), "horizon": horizon})
    save_predictor(SiDAPredictor(hash_fn, meta), path)
    return path


def test_writes_sida_beside_the_training_free_forecasters(tmp_path, synthetic_trace, tiny_fingerprint):
    artifact = sida_artifact(tmp_path / "hash", tiny_fingerprint, horizon=2)
    out = tmp_path / "forecast.json"
    report = write_forecast_eval(str(synthetic_trace), str(synthetic_trace), str(out), sida=str(artifact))
    assert json.loads(out.read_text()) == report
    assert report["horizon"] == 2 and report["artifact"] == str(artifact)
    assert set(report["forecasters"]) == {"sida", "sida-current", "token", "freq", "recency", "recency-decay",
                                          "next-token"}
    for entry in report["forecasters"].values():
        assert set(entry["horizons"]) == {"1", "2"}
        assert entry["horizons"]["1"]["n_tokens"] == 48 * 23  # 48 sequences of 24 tokens
    target = report["target"]
    best = report["forecasters"][target["best_training_free"]]["horizons"]["1"]["recall_at_2k"]
    assert target["margin"] == pytest.approx(report["forecasters"]["sida"]["horizons"]["1"]["recall_at_2k"] - best)
    assert target["met"] == (target["margin"] >= 0.1)


def test_missing_or_short_forecasts_say_what_to_train(tmp_path, synthetic_trace, tiny_fingerprint):
    trace = str(synthetic_trace)
    with pytest.raises(ForecastHorizonError, match="no forecasts; train one with --model.horizon 1"):
        write_forecast_eval(trace, trace, str(tmp_path / "a.json"), sida=str(sida_artifact(tmp_path / "old",
                                                                                           tiny_fingerprint, 0)))
    two = str(sida_artifact(tmp_path / "two", tiny_fingerprint, 2))
    with pytest.raises(ForecastHorizonError, match="--model.horizon 4"):
        write_forecast_eval(trace, trace, str(tmp_path / "b.json"), sida=two, horizon=4)
    with pytest.raises(ForecastEvalError, match="give a horizon"):
        write_forecast_eval(trace, trace, str(tmp_path / "c.json"))
    assert not any((tmp_path / f"{name}.json").exists() for name in "abc"), "a refused evaluation writes nothing"
