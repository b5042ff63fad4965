"""Routing statistics: known answers on a model whose routing is made to depend on the token
alone, and the `prescient routing-stats` command end to end."""

import json

import pytest
import torch

from cli.main import main
from prescient.loading import load_model
from training.routing_stats import routing_statistics


@pytest.fixture
def token_only_routing(tiny_moe_dir):
    """The tiny Mixtral with attention and experts silenced and layer 1's router a copy of layer
    0's: every layer routes each token by its id alone, the same way."""
    model, _ = load_model(tiny_moe_dir("mixtral"), dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.experts.down_proj.zero_()
        model.model.layers[1].mlp.gate.weight.copy_(model.model.layers[0].mlp.gate.weight)
    return model


def test_known_answers_when_routing_follows_the_token_alone(token_only_routing):
    windows = torch.randint(3, token_only_routing.config.vocab_size, (6, 20), generator=torch.Generator().manual_seed(0))
    stats = routing_statistics(token_only_routing, windows, windows, batch_size=4)
    assert stats["lookahead_recall"][0] is None
    assert stats["lookahead_recall"][1] == pytest.approx(1.0)  # the next router sees the same hidden state
    assert stats["token_table_recall"] == pytest.approx([1.0, 1.0])  # fit on these very windows
    assert stats["expert_load"][0] == pytest.approx(stats["expert_load"][1])
    for shares in stats["expert_load"]:
        assert sum(shares) == pytest.approx(1.0)
    # a token repeats its top-1 expert exactly where the next token routes the same way
    ids = windows
    top1 = token_only_routing.model.layers[0].mlp.gate(token_only_routing.model.layers[0].post_attention_layernorm(
        token_only_routing.model.embed_tokens(ids)))
    top1 = (top1[0] if isinstance(top1, tuple) else top1).argmax(-1).reshape(ids.shape)
    assert stats["top1_repeat"][0] == pytest.approx(float((top1[:, 1:] == top1[:, :-1]).float().mean()))
    assert all(0 < share <= 1 for share in stats["router_entropy_share"])


def test_routing_stats_command_writes_json_and_plot(tiny_moe_dir, text_corpus, tmp_path, capsys):
    out = tmp_path / "routing.json"
    main(["routing-stats", "--model", str(tiny_moe_dir("mixtral")), "--dataset", f"json:{text_corpus}",
          "--split", "train", "--fit-split", "train", "--seq-len", "16", "--windows", "4", "--fit-windows", "4",
          "--json", str(out), "--plot", str(tmp_path / "routing.png")])
    result = json.loads(out.read_text())
    assert result["windows"] == 4 and result["statistics"]["tokens"] == 4 * 16
    assert (tmp_path / "routing.png").stat().st_size > 0
    assert "lookahead_recall" in capsys.readouterr().out
