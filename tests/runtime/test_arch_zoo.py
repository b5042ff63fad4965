"""Every MoE architecture of the installed transformers, enumerated from transformers itself and
built tiny (hidden 64, 4 layers, 8 experts, top-2 where allowed): greedy generation through
`load_offloaded` at 0.5/LRU and 0.25/MRS equals the plain model's, or the family is refused in
one line that names it and the reason; and on each exact one, tracing, SiDA training (the
LightningCLI entry), evaluation and serving with the hash function work, and CGOPipe decodes
exactly or refuses with its reason. The default run checks one family per way of calling experts
and per refusal (and the pipeline on three); `-m slow` sweeps them all."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from cli import archs as archs_cli
from experiments.arch_pipeline import with_pipeline
from experiments.arch_support import check_family, greedy, markdown_table, prompt_inputs, support_table
from predictor.sida import read_token_embeddings
from offload_runtime.engine.loader import load_offloaded
from prescient.arch_zoo import Family, moe_families, save_tiny_model, tiny_config
from prescient.loading import load_model

# one family per convention: experts called without ids (Llama 4), a router inside the decoder layer
# returning probabilities (Gemma 4), experts flattened along their rows (DBRX), zero-computation
# experts (LongCat-Flash), top-1 with a skip expert and a 4-output router (Zaya), up-projection-only
# experts in a hybrid Mamba model (Nemotron-H)
FAST = ("llama4_text", "gemma4_text", "dbrx", "longcat_flash", "zaya", "nemotron_h")
REFUSED = {
    "doge": "embedding tables",
    "jetmoe": "JetMoeParallelExperts",
    "nllb-moe": "experts 0 and 1 run for every token",
}


def family(model_type: str) -> Family:
    return next(f for f in moe_families() if f.model_type == model_type)


def test_families_come_from_the_installed_transformers():
    names = {f.model_type for f in moe_families()}
    assert {"mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss", "llama4_text", "gemma4_text", "switch_transformers",
            *FAST, *REFUSED} <= names
    assert not names & {"llama", "gpt2", "qwen3", "t5"}  # dense models name no experts
    assert family("switch_transformers").encoder_decoder and not family("mixtral").encoder_decoder


def test_tiny_configs_are_tiny():
    config = tiny_config("gemma4_text")
    assert (config.hidden_size, config.num_hidden_layers, config.num_experts, config.top_k_experts) == (64, 4, 8, 2)
    assert tiny_config("zaya").num_experts_per_tok == 1  # Zaya allows top-1 only
    layer_types = tiny_config("granitemoehybrid").layer_types
    assert len(layer_types) == 4 and {"linear_attention", "full_attention"} == set(layer_types)


@pytest.mark.parametrize("model_type", FAST)
def test_new_conventions_are_exact(model_type, tmp_path):
    row = check_family(family(model_type), tmp_path)
    assert row.status == "exact", row.detail


@pytest.mark.parametrize("model_type", FAST)
def test_new_conventions_are_exact_when_experts_run_in_groups(model_type, tmp_path):
    """Two slots: each layer's chosen experts load and run a group at a time."""
    path = save_tiny_model(family(model_type), tmp_path)
    inputs = prompt_inputs(encoder_decoder=False)
    plain, _ = load_model(path, dtype=torch.float32)
    model = load_offloaded(path, policy="lru", budget="2slots")
    with model.runtime as runtime:
        assert torch.equal(greedy(model, inputs), greedy(plain, inputs))
    assert runtime.stats().slots == 2


@pytest.mark.parametrize(("model_type", "reason"), REFUSED.items())
def test_refusals_name_the_family_and_the_reason(model_type, reason, tmp_path):
    row = check_family(family(model_type), tmp_path)
    assert row.status == "refused" and row.detail.startswith(model_type) and reason in row.detail
    assert "\n" not in row.detail


def test_longcat_without_zero_experts_when_slots_outnumber_a_layers_experts(tmp_path):
    """The slot pool (16 slots at 0.5 of 4 x 8 experts) holds more slots than one layer has
    experts; the twin's expert counts follow the slots, so LongCat's one-hot over
    `total_experts` still fits."""
    config = tiny_config("longcat_flash")
    config.zero_expert_num = 0
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).eval().save_pretrained(tmp_path)
    inputs = prompt_inputs(encoder_decoder=False)
    plain, layers = load_model(tmp_path, dtype=torch.float32)
    assert layers[0].num_choices == layers[0].num_experts == 8
    model = load_offloaded(tmp_path, policy="lru", budget=0.5)
    with model.runtime as runtime:
        assert torch.equal(greedy(model, inputs), greedy(plain, inputs))
    assert runtime.stats().slots == 16


def test_unknown_family_is_a_clear_error():
    with pytest.raises(Exception, match="no MoE family named nope.*prescient archs"):
        support_table(["nope"])


def test_archs_command_prints_and_writes_the_table(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    archs_cli.add_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "archs.json"
    args = parser.parse_args(["archs", "--family", "mixtral", "--family", "doge", "--markdown", "--json", str(out)])
    rows = archs_cli.run(args)
    assert [(r["family"], r["status"]) for r in rows] == [("doge", "refused"), ("mixtral", "exact")]
    assert json.loads(out.read_text())["rows"] == rows
    printed = capsys.readouterr().out
    assert printed.startswith("2 MoE architectures: 1 refused, 1 exact.") and "| `mixtral` | exact |" in printed
    assert "| `mixtral` | exact | 4 MoE layers, 8 experts, top-2, fused |" in printed


def test_archs_pipeline_traces_trains_evaluates_and_serves(tmp_path, capsys):
    """`--pipeline` on Mixtral (CGOPipe exact), Nemotron-H (one MoE layer of four in a hybrid Mamba
    model, its embeddings saved as `backbone.embeddings.weight`; CGOPipe refused) and LongCat-Flash
    (zero-computation experts: tracing refused, naming the family)."""
    parser = argparse.ArgumentParser()
    archs_cli.add_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "archs.json"
    args = parser.parse_args(["archs", "--family", "mixtral", "--family", "nemotron_h", "--family", "longcat_flash",
                              "--pipeline", "--markdown", "--json", str(out)])
    rows = {r["family"]: r for r in archs_cli.run(args)}
    assert rows["mixtral"]["pipeline"].startswith("ok (400 tokens traced") and rows["mixtral"]["cgopipe"] == "exact"
    assert rows["nemotron_h"]["detail"].startswith("1 of 4 layers MoE,")
    assert rows["nemotron_h"]["pipeline"].startswith("ok") and rows["nemotron_h"]["cgopipe"].startswith("refused: ")
    assert rows["longcat_flash"]["pipeline"].startswith("trace refused: longcat_flash: MoE layer ")
    assert "zero-computation expert" in rows["longcat_flash"]["pipeline"]
    assert json.loads(out.read_text())["command"] == "prescient archs --pipeline"
    printed = capsys.readouterr().out
    assert "| family | offloaded generation | detail | trace, train, evaluate, serve SiDA | CGOPipe |" in printed
    assert "3 MoE architectures: 3 exact. Trace + SiDA training + evaluation + serving with it, of the 3 exact: " \
           "2 ok, 1 trace refused. CGOPipe: 2 refused, 1 exact." in printed


def test_sida_reads_the_models_own_input_embedding_under_any_name(tmp_path):
    """DBRX saves its embeddings as `transformer.wte.weight`: found through the model's own
    `get_input_embeddings()` and transformers' renaming."""
    path = save_tiny_model(family("dbrx"), tmp_path)
    plain, _ = load_model(path, dtype=torch.float32)
    torch.testing.assert_close(read_token_embeddings(path), plain.get_input_embeddings().weight)


@pytest.mark.slow
def test_every_family_is_exact_or_refused(tmp_path):
    rows = support_table(workdir=tmp_path)
    bad = [r for r in rows if r.status not in ("exact", "refused")]
    assert not bad, markdown_table(bad)
    assert sum(r.status == "exact" for r in rows) > 50


@pytest.mark.slow
def test_every_exact_family_traces_trains_evaluates_and_serves(tmp_path):
    """On every exact family: trace, SiDA training, evaluation and serving with it work (or are
    refused with a reason), and CGOPipe is exact or refused with a reason."""
    rows = [r for r in with_pipeline(support_table(workdir=tmp_path), workdir=tmp_path) if r.status == "exact"]
    bad = [r for r in rows if not (r.pipeline.startswith("ok") or " refused: " in r.pipeline)
           or not (r.cgopipe == "exact" or r.cgopipe.startswith("refused: "))]
    assert not bad, markdown_table(bad)
    assert [r.family for r in rows if not r.pipeline.startswith("ok")] == ["longcat_flash"]
    assert sum(r.cgopipe == "exact" for r in rows) >= 10
