"""One object for an opened model directory: checked once, parsed once, passed down."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoConfig

from offload_runtime.compression.writer import quantize_model
from offload_runtime.engine.generate import generate_offloaded
from offload_runtime.engine.loader import load_offloaded
from prescient.errors import ModelFilesError
from prescient.fingerprint import fingerprint_model_dir
from prescient.loading import load_tokenizer
from prescient.model_dir import ModelDirectory


@pytest.fixture
def opened(monkeypatch):
    """Counts of what each call reads: directories opened, typed configs built by transformers,
    and config.json files parsed as JSON by us."""
    counts = {"open": 0, "auto_config": 0}
    real_open, real_config = ModelDirectory.open.__func__, AutoConfig.from_pretrained.__func__

    def open_(cls, path):
        counts["open"] += 1
        return real_open(cls, path)

    def config(cls, *args, **kwargs):
        counts["auto_config"] += 1
        return real_config(cls, *args, **kwargs)

    monkeypatch.setattr(ModelDirectory, "open", classmethod(open_))
    monkeypatch.setattr(AutoConfig, "from_pretrained", classmethod(config))
    return counts


def copy_model(source, tmp_path):
    return shutil.copytree(source, tmp_path / "model")


@pytest.mark.parametrize("damage, message", [
    (lambda d: shutil.rmtree(d), r"model directory .*model does not exist; give the path"),
    (lambda d: (d / "config.json").unlink(), r"model has no config.json; expected a Hugging Face model directory"),
    (lambda d: (d / "config.json").write_text("{"), r"model/config.json is not valid JSON .*; restore"),
    (lambda d: (d / "model.safetensors.index.json").write_text("[1, "), r"weight index .*index.json is corrupt"),
    (lambda d: (d / "model.safetensors").write_bytes(b"\x00" * 16), r"weight file .*model.safetensors is corrupt"),
])
def test_opening_a_damaged_directory_is_one_line(damage, message, tiny_moe_dir, tmp_path):
    path = copy_model(tiny_moe_dir("mixtral"), tmp_path)
    damage(path)
    with pytest.raises(ModelFilesError, match=message) as caught:
        ModelDirectory.open(path)
    assert "\n" not in str(caught.value)


def test_an_opened_directory_holds_what_it_read(tiny_moe_dir):
    path = tiny_moe_dir("mixtral")
    directory = ModelDirectory.open(path)
    assert ModelDirectory.of(directory) is directory
    assert str(directory) == str(path) and directory.path == path
    assert directory.config_dict == json.loads((path / "config.json").read_text())
    assert directory.config.to_dict() == AutoConfig.from_pretrained(path).to_dict()
    assert directory.weight_files == [path / "model.safetensors"]
    key = directory.checkpoint_key("model.embed_tokens.weight")
    assert directory.weight_index[key] == path / "model.safetensors"
    assert directory.tokenizer() is directory.tokenizer()
    assert fingerprint_model_dir(directory) is fingerprint_model_dir(directory) == fingerprint_model_dir(path)
    dtype = directory.config.dtype
    model = directory.weightless_model(torch.bfloat16)
    assert all(p.device.type == "meta" and p.dtype == torch.bfloat16 for p in model.parameters())
    assert directory.config.dtype == dtype  # built from a copy: the shared config is unchanged


def test_generate_opens_and_parses_the_model_once(opened, tiny_moe_dir):
    """Tokenizer, prompt check, weights without experts, fingerprint (bf16: read from the
    directory in float32) and the expert store all take the one opened directory."""
    path = tiny_moe_dir("mixtral")
    load_tokenizer(path)  # transformers' tokenizer loader may build the config for itself
    by_tokenizer = opened["auto_config"]
    opened.update(open=0, auto_config=0)
    record = generate_offloaded(path, "def f(x):", 2, dtype="bfloat16")
    assert len(record["token_ids"]) == 2
    assert opened["open"] == 1
    assert opened["auto_config"] == 1 + by_tokenizer


def test_quantize_opens_the_source_once(opened, tiny_moe_dir, tmp_path):
    quantize_model(tiny_moe_dir("mixtral"), tmp_path / "int8", 8)
    assert opened["open"] == 2  # the source, then the written copy for the fingerprint check
    assert opened["auto_config"] == 2


def test_an_opened_directory_names_its_compression(tiny_moe_dir, tmp_path):
    plain = ModelDirectory.open(tiny_moe_dir("mixtral"))
    quantize_model(plain, tmp_path / "int4", 4)
    packed = ModelDirectory.open(tmp_path / "int4")
    assert plain.compression is None
    module = next(key for key in packed.weight_index if key.endswith(".weight_packed")).rsplit(".", 1)[0]
    assert packed.compression.for_module(module, "test").args.num_bits == 4


def test_an_opened_directory_loads_the_same_offloaded_model_as_its_path(tiny_moe_dir):
    path = tiny_moe_dir("mixtral")
    ids = torch.tensor([[3, 5, 7, 11]])
    outputs = []
    for model_dir in (path, ModelDirectory.open(path)):
        model = load_offloaded(model_dir, None, budget=0.5)
        with model.runtime as runtime, torch.inference_mode():
            outputs.append((model(ids).logits, runtime.fingerprint, runtime.store.model_dir))
    (logits, fingerprint, where), (logits_opened, fingerprint_opened, where_opened) = outputs
    torch.testing.assert_close(logits_opened, logits, rtol=0, atol=0)
    assert fingerprint_opened == fingerprint and where_opened == where == path
