"""The reference-model recipe: recipes, the cache, resuming, and the zero-widening that makes `bench`."""

import json

import lightning as L
import pytest
import torch

from prescient.atomic import write_json_atomic
from training.reference_model import REPORT, TRAIN_DIR, build_reference_model, widen_experts
from training.reference_recipe import ReferenceModelError, read_recipe, recipe


def test_recipes_are_read_from_yaml():
    for size in ("tiny", "base"):
        spec = recipe(size)
        assert spec["model"]["num_local_experts"] >= 16
        assert spec["model"]["num_hidden_layers"] >= 4
        assert spec["model"]["num_experts_per_tok"] == 2
        assert spec["model"]["router_aux_loss_coef"] > 0  # load balancing stays on
    assert recipe("base")["model"]["num_hidden_layers"] > recipe("tiny")["model"]["num_hidden_layers"]
    assert recipe("bench")["base_recipe"] == recipe("base")
    with pytest.raises(ValueError, match="tiny, base, bench"):
        recipe("huge")


def test_a_widening_recipe_must_name_a_trained_base(tmp_path):
    (tmp_path / "wide.yaml").write_text("base: bench\nexpert_intermediate_size: 1024\n")
    with pytest.raises(ReferenceModelError, match="base must name a trained recipe"):
        read_recipe(tmp_path / "wide.yaml")
    (tmp_path / "narrow.yaml").write_text("base: tiny\nexpert_intermediate_size: 8\n")
    with pytest.raises(ReferenceModelError, match="expert_intermediate_size must be an integer at least"):
        read_recipe(tmp_path / "narrow.yaml")


def test_a_built_model_is_returned_without_training(tmp_path, monkeypatch):
    out = tmp_path / "ref"
    out.mkdir()
    write_json_atomic(out / REPORT, {"recipe": recipe("tiny")})
    monkeypatch.setattr("training.reference_model.train_reference", lambda *a: pytest.fail("retrained a cached model"))
    assert build_reference_model("tiny", out) == out


def test_a_changed_recipe_is_rebuilt(tmp_path, monkeypatch):
    out = tmp_path / "ref"
    out.mkdir()
    write_json_atomic(out / REPORT, {"recipe": {**recipe("tiny"), "seed": 123}})
    calls = []
    monkeypatch.setattr("training.reference_model.train_reference", lambda *a: calls.append(a))
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


MICRO = {  # a recipe small enough to train in seconds
    "seed": 0,
    "tokenizer": {"vocab_size": 300, "train_chars": 20000},
    "model": {"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
              "intermediate_size": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
              "router_aux_loss_coef": 0.02, "max_position_embeddings": 32, "tie_word_embeddings": True},
    "training": {"corpus_chars": 20000, "seq_len": 16, "batch_size": 4, "max_steps": 20, "lr": 0.004,
                 "warmup_steps": 2, "weight_decay": 0.1, "layer_balance_coef": 0.05, "val_windows": 4,
                 "val_every": 5},
}


class StopAt(L.Callback):
    """Ctrl-C at a given step, as a user would press it."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            raise KeyboardInterrupt


def test_an_interrupted_build_resumes_where_it_stopped(tmp_path, monkeypatch):
    import yaml

    recipe_file = tmp_path / "micro.yaml"
    recipe_file.write_text(yaml.safe_dump(MICRO))
    out = tmp_path / "micro"
    trainer_init = L.Trainer.__init__

    def interrupting(self, *args, callbacks=(), **kwargs):
        trainer_init(self, *args, callbacks=[*callbacks, StopAt(12)], **kwargs)

    monkeypatch.setattr(L.Trainer, "__init__", interrupting)
    with pytest.raises(SystemExit):  # Lightning's answer to Ctrl-C, after our checkpoint on the way out
        build_reference_model(out=out, recipe_file=recipe_file)
    assert not (out / REPORT).exists()
    saved = torch.load(out / TRAIN_DIR / "last.ckpt", weights_only=False)
    assert saved["global_step"] == 12
    loader_state = saved["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert loader_state == {"epoch": 0, "served": 12 * MICRO["training"]["batch_size"]}  # the epoch is longer
    monkeypatch.setattr(L.Trainer, "__init__", trainer_init)
    steps = []
    fit = L.Trainer.fit
    monkeypatch.setattr(L.Trainer, "fit", lambda self, *a, **kw: steps.append(kw["ckpt_path"]) or fit(self, *a, **kw))
    build_reference_model(out=out, recipe_file=recipe_file)
    assert steps == [str(out / TRAIN_DIR / "last.ckpt")]
    report = json.loads((out / REPORT).read_text())
    assert [p["step"] for p in report["val_curve"]] == [5, 10, 15, 20]  # the curve spans both runs
    assert not (out / TRAIN_DIR).exists()
    routing = report["routing"]
    assert routing["layers"] == 2 and routing["lookahead_recall"][0] is None
    assert 0 <= routing["summary"]["lookahead_recall"] <= 1
