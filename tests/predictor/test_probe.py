"""The hidden-state probe end to end on a tiny 3-layer Mixtral: a trace with hidden states, a few
Lightning epochs, the artifact, lookahead shapes and hooks, evaluation beside gate lookahead."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cli.main import main as prescient
from experiments.evaluate import evaluate_predictors
from predictor import GateLookahead, PredictorError, ProbeLookahead, load_predictor, load_probe, recall_at
from prescient.arch_zoo import save_tiny_model
from prescient.errors import FingerprintMismatchError
from prescient.loading import load_model
from prescient.traces import load_trace
from tests.conftest import tiny_test_config
from training.predictor_cli import train_predictor
from training.probe_module import ProbeModule
from training.tracing import trace_model

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs/predictor/probe.yaml"
TRACE = {"max_tokens": 600, "top_t": 8, "seq_len": 32, "batch_size": 8, "shard_sequences": 8}
SMALL = {"trainer.logger": "false", "trainer.enable_progress_bar": "false", "trainer.enable_model_summary": "false",
         "model.ahead": 2, "model.hidden_dim": 32, "data.batch_size": 64, "model.lr": 0.01}


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_tokenizer, text_corpus) -> dict:
    tmp = tmp_path_factory.mktemp("probe")
    model_dir = save_tiny_model(tiny_test_config("mixtral", tiny_tokenizer, num_hidden_layers=3), tmp / "model",
                                tokenizer=tiny_tokenizer)
    trace = trace_model(model_dir, f"json:{text_corpus}", tmp / "trace", split="train", hidden_states=True, **TRACE)
    export = tmp / "probe"
    train_predictor(CONFIG, trace, export, **SMALL, **{"trainer.max_epochs": 12,
                                                       "trainer.default_root_dir": tmp / "run"})
    model, _ = load_model(model_dir, dtype=torch.float32)
    return {"tmp": tmp, "model_dir": model_dir, "trace": trace, "export": export, "model": model}


def test_training_learns_the_next_layers_routers_and_exports_an_artifact(world):
    probe = load_probe(world["export"], world["model"])
    assert isinstance(probe, ProbeLookahead) and probe.max_ahead == 2
    meta = json.loads(world["export"].with_suffix(".json").read_text())
    assert meta["kind"] == "probe" and meta["hparams"] == {"ahead": 2, "hidden_dim": 32, "hidden_size": 32,
                                                           "activation": "silu"}
    assert meta["training"]["trace_dir"] == str(world["trace"])
    trace = load_trace(world["trace"], hidden=True)
    torch.manual_seed(0)
    untrained = ProbeModule(str(world["trace"]), ahead=2, hidden_dim=32).to_predictor()
    true = trace["topk_ids"].long()
    for ahead in (1, 2):
        def recall(p: ProbeLookahead) -> float:
            guess = torch.stack([p.lookahead(j - ahead, trace["hidden"][:, j - ahead], ahead) for j in range(ahead, 3)], 1)
            return float(recall_at(guess, true[:, ahead:], 2))
        assert recall(probe) > recall(untrained) + 0.2, (ahead, recall(probe), recall(untrained))
    assert meta["metrics"]["val/recall_at_k"] > 0.5 and "val/recall_at_k_a2" in meta["metrics"]


def test_lookahead_shapes_offsets_and_hooks(world):
    probe = load_probe(world["export"], world["model"])
    hidden = torch.randn(2, 5, 32)
    assert probe.lookahead(0, hidden).shape == (2, 5, 8)
    assert probe.lookahead(0, hidden[0, 0], ahead=2).shape == (8,)
    per_layer = torch.randn(5, 3, 32)
    with torch.no_grad():
        every = probe.heads(per_layer)  # [5, P, E]: the pairs training runs at once are those lookahead serves
    for i, (layer, ahead) in enumerate(probe.heads.pairs):
        torch.testing.assert_close(every[:, i], probe.lookahead(layer, per_layer[:, layer], ahead))
    with pytest.raises(PredictorError, match="looks 1..2 layers ahead, not 3; train one with --model.ahead 3"):
        probe.lookahead(0, hidden, ahead=3)
    with pytest.raises(PredictorError, match="no next MoE layer"):
        probe.lookahead(1, hidden, ahead=2)
    ids = torch.randint(0, 300, (2, 6))
    seen: list[tuple[int, torch.Tensor]] = []
    probe.attach(lambda layer, logits: seen.append((layer, logits)))
    inputs = probe.block_inputs(ids)  # runs the model once with the hooks on
    probe.detach(probe._callbacks[0])
    assert [layer for layer, _ in seen] == [0, 1, 2, 2]  # block 0: itself, +1, +2; block 1: +1
    torch.testing.assert_close(seen[2][1], probe.lookahead(0, inputs[0], 2).reshape(seen[2][1].shape))
    assert not any(layer.block._forward_pre_hooks for layer in probe.layers), "detach removes the hooks"
    scores = probe.predict(ids)
    state = probe.start(2)
    steps = torch.stack([probe.step(state, ids[:, t]) for t in range(6)], dim=1)
    assert scores.shape == (2, 6, 3, 8)
    torch.testing.assert_close(steps, scores, atol=1e-4, rtol=1e-4)


def test_traced_hidden_states_are_what_the_hooks_see(world):
    """The probe trained on the trace's column meets, when serving, the tensor the hooks hand it."""
    trace = load_trace(world["trace"], hidden=True)
    probe = load_probe(world["export"], world["model"])
    rows = trace.sequences()[0]
    inputs = probe.block_inputs(trace["token_id"][rows][None])
    for layer in range(3):
        torch.testing.assert_close(inputs[layer][0].to(torch.bfloat16), trace["hidden"][rows, layer])


def test_gate_lookahead_looks_several_layers_ahead(world):
    gate = GateLookahead(world["model"], ahead=2)
    hidden = torch.randn(4, 32)
    expected = torch.nn.functional.linear(hidden, gate.layers[2].router.weight)
    torch.testing.assert_close(gate.lookahead(0, hidden, ahead=2), expected)
    seen: list[int] = []
    gate.attach(lambda layer, _logits: seen.append(layer))
    gate.block_inputs(torch.randint(0, 300, (1, 3)))
    assert seen == [0, 1, 2, 2]


def test_a_probe_loads_only_into_its_model(world, tiny_tokenizer):
    other_dir = save_tiny_model(tiny_test_config("mixtral", tiny_tokenizer, num_hidden_layers=3),
                                world["tmp"] / "other", seed=1, tokenizer=tiny_tokenizer)
    other, _ = load_model(other_dir, dtype=torch.float32)
    with pytest.raises(FingerprintMismatchError):
        load_probe(world["export"], other)
    unbound = load_predictor(world["export"])
    with pytest.raises(PredictorError, match="runs the live model: bind"):
        unbound.predict(torch.zeros(1, 2, dtype=torch.long))


def test_evaluate_reports_the_probe_per_layer_and_offset_beside_gate_lookahead(world):
    result = evaluate_predictors(world["trace"], {"lookahead": None, "probe": world["export"]},
                                 model_dir=world["model_dir"], batch_sizes=(1,))
    gate, probe = result["predictors"]["lookahead"], result["predictors"]["probe"]
    assert probe["kind"] == "probe" and probe["model"] == str(world["model_dir"])
    assert sorted(gate["ahead"]) == sorted(probe["ahead"]) == ["1", "2"]
    assert probe["ahead"]["2"]["per_layer"]["recall_at_k"][:2] == [None, None]
    assert probe["ahead"]["1"]["per_layer"]["recall_at_k"][1:] == probe["per_layer"]["recall_at_k"][1:]
    assert probe["per_layer"]["recall_at_k"][0] == gate["per_layer"]["recall_at_k"][0] == 1.0  # layer 0: its router
    assert 0.5 < probe["ahead"]["1"]["recall_at_k"] <= 1


def test_a_probe_needs_a_trace_with_hidden_states_and_a_model(world, text_corpus, tmp_path, caplog):
    plain = trace_model(world["model_dir"], f"json:{text_corpus}", tmp_path / "plain", split="validation",
                        max_tokens=40, top_t=4, seq_len=16)
    with pytest.raises(SystemExit) as exit_info:
        prescient(["train", "--config", str(CONFIG), "--data.trace_dir", str(plain), "--export", str(tmp_path / "p")])
    assert exit_info.value.code == 2
    assert f"trace {plain} holds no hidden states; trace it again with `prescient trace ... --hidden-states`" \
        in caplog.messages[-1]
    with pytest.raises(SystemExit) as exit_info:
        prescient(["evaluate", "--trace", str(plain), "--predictors", f"probe={world['export']}",
                   "--json", str(tmp_path / "e.json")])
    assert exit_info.value.code == 2
    assert "predictor 'probe' runs the live model: pass --model DIR" in caplog.messages[-1]
