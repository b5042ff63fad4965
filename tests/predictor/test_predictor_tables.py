"""Frequency, token table, correlation table and oracle on hand-made traces."""

import pytest
import torch

from predictor import (
    CorrelationTable,
    FrequencyPredictor,
    OraclePredictor,
    PredictorError,
    TokenTablePredictor,
    load_predictor,
    recall_at,
    save_predictor,
)
from prescient.traces import load_trace

# two sequences, 5 tokens, 3 layers, top-2 of 8 experts
SEQUENCES = [[1, 2, 1, 3], [2, 1]]
K = 2
TOPK = torch.tensor([
    [[0, 1], [2, 3], [4, 5]],  # token 1
    [[6, 7], [2, 3], [0, 1]],  # token 2
    [[0, 2], [2, 4], [4, 5]],  # token 1
    [[0, 1], [5, 6], [7, 0]],  # token 3
    [[6, 7], [3, 2], [0, 1]],  # token 2
    [[0, 1], [2, 3], [4, 6]],  # token 1
])


@pytest.fixture
def hand_trace(tmp_path, make_hand_trace):
    return load_trace(make_hand_trace(tmp_path / "hand", SEQUENCES, TOPK))


def test_global_frequency(hand_trace):
    pred = FrequencyPredictor.from_trace(hand_trace)
    assert pred.counts[0].tolist() == [4, 3, 1, 0, 0, 0, 2, 2]
    scores = pred.predict(torch.tensor([[5, 9, 1]]))
    assert scores.shape == (1, 3, 3, 8)
    assert scores[0, 0, 0].topk(2).indices.tolist() == [0, 1]
    assert scores[0, 0, 1].topk(2).indices.tolist() == [2, 3]  # counts 5, 4
    torch.testing.assert_close(pred.step(pred.start(1), torch.tensor([1])), scores[:, 2])


def test_token_table_and_its_fallback(hand_trace):
    pred = TokenTablePredictor.from_trace(hand_trace)
    scores = pred.predict(torch.tensor([[1, 2, 3, 39]]))
    assert scores[0, 0, 0].topk(1).indices.item() == 0  # token 1: expert 0 in all three
    assert scores[0, 0, 2].topk(2).indices.tolist() == [4, 5]  # token 1, layer 2: 4 ×3, then 5 ×2
    assert scores[0, 1, 0].topk(2).indices.sort().values.tolist() == [6, 7]  # token 2, layer 0
    assert scores[0, 2, 1].topk(2).indices.sort().values.tolist() == [5, 6]  # token 3 seen once
    unseen = scores[0, 3]  # token 39 never traced: the global frequency
    global_scores = FrequencyPredictor.from_trace(hand_trace).predict(torch.tensor([[39]]))[0, 0]
    for layer in range(3):
        assert set(unseen[layer].topk(2).indices.tolist()) == set(global_scores[layer].topk(2).indices.tolist())


def test_correlation_counts_on_a_hand_made_trace(hand_trace):
    table = CorrelationTable.from_trace(hand_trace, path_length=2)
    d1, d2 = table.pairs
    assert d1.shape == (2, 8, 8) and d2.shape == (1, 8, 8)
    # layer 0 expert 0 (tokens 0, 2, 3, 5) → layer 1: {2,3}, {2,4}, {5,6}, {2,3}
    assert d1[0, 0].tolist() == [0, 0, 3, 2, 1, 1, 1, 0]
    # layer 0 expert 6 (tokens 1, 4) → layer 2: {0,1} twice
    assert d2[0, 6].tolist() == [2, 2, 0, 0, 0, 0, 0, 0]
    assert d1.sum() == 6 * 2 * 2 * 2  # tokens × layer pairs × k × k

    # multi-batch: all tokens that chose {0, 1} or {6, 7} at layer 0 → layer 1's hot experts
    hot = table.hot_experts(0, torch.tensor([[0, 1], [6, 7]]), k=2)
    assert sorted(hot.tolist()) == [2, 3]
    with pytest.raises(PredictorError, match="no next MoE layer"):
        table.next_layer_scores(2, torch.tensor([[0, 1]]))


def test_correlation_online_updates_are_never_written_back(tmp_path, hand_trace):
    save_predictor(CorrelationTable.from_trace(hand_trace), tmp_path / "corr")
    stored = (tmp_path / "corr.safetensors").read_bytes()
    table = load_predictor(tmp_path / "corr")
    selected, nxt = torch.tensor([[7, 6]] * 50), torch.tensor([[1, 0]] * 50)
    before = table.hot_experts(0, selected, k=2)
    table.update(0, selected, nxt)
    assert sorted(table.hot_experts(0, selected, k=2).tolist()) == [0, 1] != sorted(before.tolist())
    assert (tmp_path / "corr.safetensors").read_bytes() == stored
    fresh = load_predictor(tmp_path / "corr")
    torch.testing.assert_close(fresh.hot_experts(0, selected, k=2), before)


def test_correlation_predict_chains_from_the_layer0_token_table(hand_trace):
    table = CorrelationTable.from_trace(hand_trace)
    scores = table.predict(torch.tensor([[2]]))
    assert scores.shape == (1, 1, 3, 8)
    assert scores[0, 0, 0].topk(2).indices.sort().values.tolist() == [6, 7]
    assert scores[0, 0, 1].topk(2).indices.sort().values.tolist() == [2, 3]  # rows of 6 and 7


def test_oracle_has_recall_one(hand_trace):
    oracle = OraclePredictor(hand_trace)
    topk = hand_trace["topk_ids"]
    assert recall_at(oracle.rows(0, torch.arange(4)), topk[:4], 2) == 1.0
    assert recall_at(oracle.predict(torch.tensor([SEQUENCES[0]])), topk[None, :4], 2) == 1.0
    state = oracle.start(2)
    steps = [oracle.step(state, torch.tensor([a, b])) for a, b in zip(SEQUENCES[0][:2], SEQUENCES[1])]
    assert recall_at(torch.stack(steps, 1)[1], topk[4:6], 2) == 1.0
    assert torch.equal(oracle.rows(1, torch.arange(2)), torch.stack(steps, 1)[1])
    with pytest.raises(PredictorError, match="only knows token sequences of its trace"):
        oracle.predict(torch.tensor([[3, 3]]))


def test_oracle_forecasts_are_the_next_tokens_true_choices_with_certain_chances(hand_trace):
    oracle = OraclePredictor(hand_trace)
    truth = torch.zeros(len(TOPK), 3, 8).scatter_(-1, TOPK.long(), 1.0)  # [N, L, E] the router's picks
    current, ahead = oracle.predict_with_forecasts(torch.tensor([SEQUENCES[0]]), horizon=2)
    assert ahead.shape == (1, 4, 2, 3, 8)
    assert torch.equal(oracle.chance_selected(current[0], K), truth[:4])
    chances = oracle.chance_selected(ahead[0], K)  # [T, h, L, E]
    assert torch.equal(chances[:, 0], torch.cat([truth[1:4], torch.zeros(1, 3, 8)]))  # none past the end
    assert torch.equal(chances[:, 1], torch.cat([truth[2:4], torch.zeros(2, 3, 8)]))
    state = oracle.start(1)
    oracle.step(state, torch.tensor([SEQUENCES[1][0]]))
    assert torch.equal(oracle.forecast(state), torch.cat([oracle.rows(1, torch.tensor([1])),
                                                          torch.zeros(oracle.horizon - 1, 3, 8)])[None])
