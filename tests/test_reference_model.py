"""The reference-model recipe: recipes, the cache, and the zero-widening that makes `bench`."""

import json

import pytest
import torch

from prescient.atomic import write_json_atomic
from training.reference_model import REPORT, build_reference_model, recipe, widen_experts


def test_recipes_are_read_from_yaml():
    tiny = recipe("tiny")
    assert tiny["model"]["num_local_experts"] >= 16
    assert tiny["model"]["num_hidden_layers"] >= 4
    assert tiny["model"]["num_experts_per_tok"] == 2
    assert tiny["model"]["router_aux_loss_coef"] > 0  # load balancing stays on
    bench = recipe("bench")
    assert bench["base_recipe"] == tiny
    with pytest.raises(ValueError, match="tiny, bench"):
        recipe("huge")


def test_a_built_model_is_returned_without_training(tmp_path, monkeypatch):
    out = tmp_path / "ref"
    out.mkdir()
    write_json_atomic(out / REPORT, {"recipe": recipe("tiny")})
    monkeypatch.setattr("training.reference_model.train_tiny", lambda *a: pytest.fail("retrained a cached model"))
    assert build_reference_model("tiny", out) == out


def test_a_changed_recipe_is_rebuilt(tmp_path, monkeypatch):
    out = tmp_path / "ref"
    out.mkdir()
    write_json_atomic(out / REPORT, {"recipe": {**recipe("tiny"), "seed": 123}})
    calls = []
    monkeypatch.setattr("training.reference_model.train_tiny", lambda *a: calls.append(a))
    build_reference_model("tiny", out)
    assert len(calls) == 1


def test_widened_experts_compute_and_route_like_the_base(tiny_moe_dir, tmp_path):
    base = tiny_moe_dir("mixtral")
    write_json_atomic(base / REPORT, {"recipe": "test", "val_loss": {}})
    out = tmp_path / "wide"
    widen_experts(base, out, {"expert_intermediate_size": 96})
    from transformers import AutoModelForCausalLM

    narrow = AutoModelForCausalLM.from_pretrained(base).eval()
    wide = AutoModelForCausalLM.from_pretrained(out).eval()
    assert wide.config.intermediate_size == 96
    assert wide.model.layers[0].mlp.experts.gate_up_proj.shape[1] == 2 * 96
    ids = torch.randint(0, narrow.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = narrow(ids, output_router_logits=True)
        b = wide(ids, output_router_logits=True)
    for la, lb in zip(a.router_logits, b.router_logits):
        assert torch.equal(la.topk(2).indices, lb.topk(2).indices)
    torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=1e-5)
    assert json.loads((out / REPORT).read_text())["size"] == "bench"
