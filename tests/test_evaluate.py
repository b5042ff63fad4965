"""`prescient evaluate`: predictor recall, batch set precision/recall, honesty flags, JSON, PNG,
the cross-dataset matrix and the errors for bad input, on traces written with `TraceWriter`."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from cli.evaluate import add_parser, run
from experiments.evaluate import (
    EvaluationError,
    batch_set_metrics,
    cross_dataset,
    evaluate_predictors,
)
from predictor import PredictorError, PredictorMeta, SiDAHash, SiDAPredictor, SiDASizes, TokenTablePredictor
from predictor.artifact import save_predictor
from prescient.errors import FingerprintMismatchError, TraceError
from prescient.fingerprint import ModelFingerprint
from prescient.traces import TraceManifest, TraceWriter, load_trace
from training.tracing import trace_model

VOCAB, LAYERS, EXPERTS, K = 40, 3, 8, 2
GROUPS = EXPERTS // K
FP = ModelFingerprint("synthetic", LAYERS, EXPERTS, K, VOCAB, "0" * 16)
OTHER_FP = dataclasses.replace(FP, weights_hash="f" * 16)


def group_routing(first: torch.Tensor) -> torch.Tensor:
    """[N, L, k] experts: group g = first % GROUPS at layer 0 and (g + l) % GROUPS at layer l;
    group g is experts {2g, 2g+1}. Layer l's experts alone decide layer l+1's."""
    groups = (first[:, None] + torch.arange(LAYERS)[None]) % GROUPS  # [N, L]
    return torch.stack([K * groups, K * groups + 1], dim=-1)


def write_group_trace(path: Path, seed: int = 0, shift: int = 0, fingerprint: ModelFingerprint = FP,
                      lengths: tuple[int, ...] = (12,) * 9 + (7, 5), every_token: bool = False,
                      random_layer0: bool = False) -> Path:
    """A trace of random token sequences routed by `group_routing` from group (token + shift)
    at layer 0, so the token decides every layer; or, with `random_layer0`, from a random
    group, so that nothing can guess layer 0. With `every_token`, the first sequence holds
    each token of the vocabulary once."""
    gen = torch.Generator().manual_seed(seed)
    sequences = [torch.randperm(VOCAB, generator=gen)] if every_token else []
    sequences += [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]
    tokens = torch.cat(sequences)
    first = torch.randint(0, GROUPS, tokens.shape, generator=gen) if random_layer0 else tokens + shift
    topk = group_routing(first)
    logits = torch.zeros(len(tokens), LAYERS, EXPERTS).scatter_(-1, topk, torch.tensor([2.0, 1.0]).expand_as(topk))
    topt = logits.topk(EXPERTS, dim=-1)
    writer = TraceWriter(path, TraceManifest(fingerprint, f"synthetic-{shift}", "validation", EXPERTS))
    writer.add_shard({
        "seq_id": torch.cat([torch.full((len(s),), i) for i, s in enumerate(sequences)]).long(),
        "position": torch.cat([torch.arange(len(s)) for s in sequences]).int(),
        "token_id": tokens.long(),
        "topk_ids": topk.to(torch.int16),
        "topt_ids": topt.indices.to(torch.int16),
        "topt_logits": topt.values,
    }, sequences=len(sequences))
    writer.finish()
    return path


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("eval")
    return write_group_trace(root / "train", seed=1, every_token=True), write_group_trace(root / "eval", seed=2)


@pytest.fixture(scope="module")
def result(traces) -> dict:
    train, evaluated = traces
    return evaluate_predictors(evaluated, {"freq": None, "token": None, "corr": None, "oracle": None},
                               train_trace=train)


def sida_artifact(path: Path, bidirectional: bool) -> Path:
    torch.manual_seed(0)
    sizes = SiDASizes(compress_dim=8, hidden_dim=12, attn_window=4, bidirectional=bidirectional)
    hash_fn = SiDAHash.from_embedding(torch.randn(VOCAB, 16), LAYERS, EXPERTS, sizes)
    return save_predictor(SiDAPredictor(hash_fn, PredictorMeta("sida", FP, dataclasses.asdict(sizes))), path)


def test_recall_of_the_tables_and_the_oracle(result):
    p = result["predictors"]
    assert p["token"]["recall_at_k"] == 1.0 and p["oracle"]["recall_at_k"] == 1.0
    assert p["freq"]["recall_at_k"] < 0.5  # one group of four per layer
    assert p["freq"]["recall_at_2k"] > p["freq"]["recall_at_k"]
    assert p["corr"]["per_layer"]["recall_at_k"] == [1.0] * LAYERS
    assert not any(p[n]["uses_true_previous_layer"] for n in ("freq", "token", "oracle"))
    assert "forecasts" not in result  # the oracle forecasts too, with recall 1: no report of it
    assert p["token"]["fit_on"] == result["train_trace"]["dir"] and p["token"]["fit_on"].endswith("train") and p["token"]["causal"] is True


def test_correlation_chains_from_the_true_previous_layer(tmp_path):
    train = write_group_trace(tmp_path / "train", seed=1, random_layer0=True)
    evaluated = write_group_trace(tmp_path / "eval", seed=2, random_layer0=True)
    corr = evaluate_predictors(evaluated, {"corr": None}, train_trace=train, batch_sizes=())["predictors"]["corr"]
    # layer 0 is a guess from the token (random here); layers 1.. follow the router's real choice
    layer0, *later = corr["per_layer"]["recall_at_k"]
    assert layer0 < 0.6 and later == [1.0] * (LAYERS - 1)
    assert corr["uses_true_previous_layer"] is True and corr["kind"] == "klotski-correlation"


def test_batch_precision_and_recall(result):
    for name, p in result["predictors"].items():
        for b in ("1", "8", "32"):
            assert 0 <= p["batch"][b]["precision"] <= 1 and 0 <= p["batch"][b]["recall"] <= 1, name
        # one row: k predicted and k true experts, so both equal recall@k
        assert p["batch"]["1"]["precision"] == pytest.approx(p["recall_at_k"])
        assert p["batch"]["1"]["recall"] == pytest.approx(p["recall_at_k"])
    for name in ("oracle", "token"):
        assert all(v["precision"] == v["recall"] == 1.0 for v in result["predictors"][name]["batch"].values())
    freq = result["predictors"]["freq"]["batch"]
    assert all(v["mean_predicted_experts"] == K for v in freq.values())  # same guess for every row
    assert freq["32"]["mean_true_experts"] > freq["1"]["mean_true_experts"] == K


def test_batch_union_on_a_hand_made_example():
    # one layer, 4 experts, k = 1; sequence A has two tokens, B one
    true = torch.tensor([[[0]], [[1]], [[2]]])
    scores = torch.nn.functional.one_hot(torch.tensor([[0], [3], [0]]), 4).float()  # predicts 0, 3, 0
    sequences = [torch.tensor([0, 1]), torch.tensor([2])]
    together = batch_set_metrics(scores, true, sequences, batch_size=2)
    # step 0: predicted {0}, true {0, 2}; step 1: predicted {3}, true {1}
    assert together["precision"] == pytest.approx(0.5) and together["recall"] == pytest.approx(0.25)
    alone = batch_set_metrics(scores, true, sequences, batch_size=1)
    assert alone["precision"] == pytest.approx(1 / 3) and alone["recall"] == pytest.approx(1 / 3)


def test_json_fields(result, traces):
    assert result["trace"]["fingerprint"] == FP.to_dict()
    assert result["trace"]["n_tokens"] == len(load_trace(traces[1]))
    assert {"dataset", "split", "n_sequences"} <= set(result["trace"])
    assert result["timing"]["total_s"] >= 0 and set(result["timing"]["predictors_s"]) == set(result["predictors"])
    for p in result["predictors"].values():
        assert len(p["per_layer"]["recall_at_k"]) == len(p["per_layer"]["recall_at_2k"]) == LAYERS
        assert {"kind", "sees", "causal", "fit_on"} <= set(p)
    json.dumps(result)


def test_baselines_fit_on_the_evaluated_trace_say_so(traces):
    out = evaluate_predictors(traces[1], {"token": None}, batch_sizes=())
    assert out["predictors"]["token"]["fit_on"] == "same trace (optimistic)" and out["train_trace"] is None


def test_sida_artifacts_report_whether_they_see_the_future(tmp_path, traces):
    specs = {"causal": sida_artifact(tmp_path / "causal", False), "bi": sida_artifact(tmp_path / "bi", True)}
    out = evaluate_predictors(traces[1], specs, batch_sizes=(1,))["predictors"]
    assert out["causal"]["causal"] is True and out["bi"]["causal"] is False
    assert out["causal"]["kind"] == "sida" and out["causal"]["artifact"].endswith("causal.json")
    assert 0 <= out["bi"]["recall_at_k"] <= 1


def test_cli_writes_json_and_png(tmp_path, traces):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    artifact = save_predictor(TokenTablePredictor.from_trace(load_trace(traces[0])), tmp_path / "table")
    args = parser.parse_args(["evaluate", "--trace", str(traces[1]), "--train-trace", str(traces[0]),
                              "--predictors", f"freq,oracle,table={artifact}", "--batch-sizes", "1,4",
                              "--json", str(tmp_path / "out.json"), "--plot", str(tmp_path / "out.png")])
    run(args)
    data = json.loads((tmp_path / "out.json").read_text())
    assert set(data["predictors"]) == {"freq", "oracle", "table"} and set(data["predictors"]["freq"]["batch"]) == {"1", "4"}
    assert data["predictors"]["table"]["recall_at_k"] == 1.0
    assert (tmp_path / "out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cross_dataset_matrix(tmp_path):
    # "code" and "docs" route every token to a different group: a table of one is useless on the other
    traces, artifacts = {}, {}
    for name, shift in (("code", 0), ("docs", 1)):
        train = write_group_trace(tmp_path / name / "train", seed=1, shift=shift, every_token=True)
        traces[name] = (train, write_group_trace(tmp_path / name / "eval", seed=2, shift=shift))
        artifacts[name] = save_predictor(TokenTablePredictor.from_trace(load_trace(train)), tmp_path / name / "table")
    matrix = cross_dataset(None, traces, artifacts)
    at_k = matrix["predictor"]["recall_at_k"]
    assert at_k["code"]["code"] == at_k["docs"]["docs"] == 1.0
    assert at_k["code"]["docs"] == at_k["docs"]["code"] == 0.0
    assert matrix["token"]["recall_at_k"] == at_k

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    cross = ",".join(f"{n}={traces[n][0]}:{traces[n][1]}:{artifacts[n]}" for n in traces)
    run(parser.parse_args(["evaluate", "--cross", cross, "--json", str(tmp_path / "x.json"),
                           "--plot", str(tmp_path / "x.png")]))
    assert json.loads((tmp_path / "x.json").read_text())["cross_dataset"]["predictor"]["recall_at_k"] == at_k
    assert (tmp_path / "x.png").stat().st_size > 0


def test_lookahead_runs_the_model_and_its_layer0_is_exact(tmp_path, tiny_moe_dir, text_corpus):
    model = tiny_moe_dir("mixtral")
    trace = trace_model(model, f"json:{text_corpus}", tmp_path / "trace", split="train", max_tokens=300,
                        top_t=4, seq_len=24, batch_size=4)
    out = evaluate_predictors(trace, {"lookahead": None, "oracle": None}, model_dir=model, batch_sizes=(1,))
    look = out["predictors"]["lookahead"]
    assert look["per_layer"]["recall_at_k"][0] == 1.0 and look["causal"] is True
    assert out["predictors"]["oracle"]["recall_at_k"] == 1.0
    with pytest.raises(EvaluationError, match="--model"):
        evaluate_predictors(trace, {"lookahead": None})


def test_artifact_of_another_model_names_both_fingerprints(tmp_path, traces):
    other = write_group_trace(tmp_path / "other", fingerprint=OTHER_FP)
    artifact = save_predictor(TokenTablePredictor.from_trace(load_trace(other)), tmp_path / "other-table")
    with pytest.raises(FingerprintMismatchError) as err:
        evaluate_predictors(traces[1], {"sida": artifact})
    assert str(FP) in str(err.value) and str(OTHER_FP) in str(err.value)
    with pytest.raises(FingerprintMismatchError):
        evaluate_predictors(traces[1], {"token": None}, train_trace=other)


def test_unknown_predictor_and_missing_trace(tmp_path, traces):
    with pytest.raises(PredictorError, match="known names: freq, token, corr, oracle, lookahead"):
        evaluate_predictors(traces[1], {"nope": None})
    with pytest.raises(TraceError):
        evaluate_predictors(tmp_path / "no-such-trace", {"freq": None})
