"""Bad input to `prescient trace`: clear, specific errors, and exit code 2 from the CLI."""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cli.main import main
from prescient.errors import DatasetError, ModelFilesError, NotAMoEModelError, TraceError
from prescient.loading import load_model
from prescient.traces import load_trace
from training.tracing import trace_model

SMALL = dict(split="train", max_tokens=40, top_t=4, seq_len=16, batch_size=4, shard_sequences=8)


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """A tiny Llama: a fine model directory without any mixture of experts."""
    config = LlamaConfig(vocab_size=len(tiny_tokenizer), hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, pad_token_id=tiny_tokenizer.pad_token_id)
    path = tmp_path_factory.mktemp("dense")
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


def broken_copy(source: Path, into: Path, damage: str) -> tuple[Path, Path]:
    """A copy of a model directory with damaged weights; returns (directory, the file to name)."""
    model = into / "model"
    if damage == "missing shard":
        LlamaForCausalLM.from_pretrained(source).save_pretrained(model, max_shard_size="20KB")
        shards = sorted(model.glob("*.safetensors"))
        assert len(shards) > 2
        shards[1].unlink()
        return model, shards[1]
    shutil.copytree(source, model)
    weights = model / "model.safetensors"
    if damage == "no weights":
        weights.unlink()
        return model, model
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncated" else os.urandom(len(data)))
    return model, weights


@pytest.mark.parametrize("damage", ["no weights", "missing shard", "truncated", "garbage"])
def test_missing_or_corrupt_weights_name_the_file(dense_dir, tmp_path, damage):
    model, named = broken_copy(dense_dir, tmp_path, damage)
    with pytest.raises(ModelFilesError, match=re.escape(str(named))):
        load_model(model)


def test_missing_model_directory(tmp_path):
    with pytest.raises(ModelFilesError, match="does not exist"):
        load_model(tmp_path / "nowhere")
    with pytest.raises(ModelFilesError, match="no config.json"):
        load_model(tmp_path)


def test_a_dense_model_is_not_an_moe(dense_dir):
    with pytest.raises(NotAMoEModelError, match="LlamaForCausalLM has no mixture-of-experts block; expected .*fused"):
        load_model(dense_dir)


def test_a_trace_folder_with_other_settings_is_refused(tiny_moe_dir, text_corpus, tmp_path):
    model, dataset, out = tiny_moe_dir("mixtral"), f"json:{text_corpus}", tmp_path / "trace"
    trace_model(model, dataset, out, **SMALL)
    with pytest.raises(TraceError, match="other settings.*max_tokens: 40 there, 50 now"):
        trace_model(model, dataset, out, **{**SMALL, "max_tokens": 50})
    with pytest.raises(TraceError, match="other settings.*fingerprint: 'mixtral.*' there, 'olmoe"):
        trace_model(tiny_moe_dir("olmoe"), dataset, out, **SMALL)
    assert len(load_trace(out)) == 40  # left as it was


def test_an_unrelated_folder_is_not_overwritten(tiny_moe_dir, text_corpus, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(TraceError, match="not a trace directory"):
        trace_model(tiny_moe_dir("mixtral"), f"json:{text_corpus}", tmp_path, **SMALL)
    with pytest.raises(TraceError, match="has no manifest.json"):
        load_trace(tmp_path)


def test_text_that_gives_no_tokens(tiny_moe_dir, tmp_path):
    data = tmp_path / "blank.jsonl"
    data.write_text('{"text": ""}\n' * 30)
    with pytest.raises(TraceError, match="gave no tokens"):
        trace_model(tiny_moe_dir("mixtral"), f"json:{data}", tmp_path / "trace", **SMALL)
    assert not (tmp_path / "trace").exists()


def cli_trace(model: Path, dataset: str, out: Path, *extra: str) -> list[str]:
    return ["trace", "--model", str(model), "--dataset", dataset, "--split", "train", "--max-tokens", "40",
            "--out", str(out), *extra]


@pytest.mark.parametrize("case, error, message", [
    ("dense model", NotAMoEModelError, "has no mixture-of-experts block"),
    ("no weights", ModelFilesError, "holds no \\*.safetensors weight files"),
    ("empty dataset", DatasetError, "is empty"),
    ("no such field", DatasetError, "no text field 'body'"),
])
def test_cli_exits_2_with_the_message(case, error, message, dense_dir, tiny_moe_dir, text_corpus, tmp_path, caplog):
    model, dataset, extra = tiny_moe_dir("mixtral"), f"json:{text_corpus}", []
    if case == "dense model":
        model = dense_dir
    elif case == "no weights":
        model, _ = broken_copy(model, tmp_path, "no weights")
    elif case == "empty dataset":
        (tmp_path / "empty.json").write_text("")
        dataset = f"json:{tmp_path / 'empty.json'}"
    else:
        extra = ["--text-field", "body"]
    with caplog.at_level(logging.ERROR), pytest.raises(SystemExit) as exit_info:
        main(cli_trace(model, dataset, tmp_path / "trace", *extra))
    assert exit_info.value.code == 2
    assert re.search(f"error: .*{message}", caplog.text), caplog.text
    with pytest.raises(error, match=message):  # the same message as the library's exception
        trace_model(model, dataset, tmp_path / "trace", text_field=extra[-1] if extra else "text", **SMALL)
