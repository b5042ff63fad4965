"""Loading a model for offloading: every tensor but the routed experts, read from the files."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from prescient.errors import ModelFilesError
from prescient.loading import load_without_experts


def test_everything_but_the_experts_equals_the_plain_model(tiny_moe):
    model, layers = load_without_experts(tiny_moe.path, torch.float32)
    plain = tiny_moe.load()
    experts = {id(p) for layer in layers for p in layer.experts.parameters()}
    assert experts and all(p.device.type == "meta" for layer in layers for p in layer.experts.parameters())
    plain_state = plain.state_dict()
    compared = 0
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in experts:
            continue
        assert tensor.device.type == "cpu", name
        torch.testing.assert_close(tensor.detach(), plain_state[name], rtol=0, atol=0, msg=name)
        compared += 1
    assert compared > 10
    for name, buffer in plain.named_buffers():  # computed buffers (rotary tables) too
        torch.testing.assert_close(model.get_buffer(name), buffer, rtol=0, atol=0, msg=name)
    assert model.generation_config.to_dict() == plain.generation_config.to_dict()
    assert not model.training


def test_a_checkpoint_missing_a_weight_is_a_clear_error(tiny_moe_dir, tmp_path):
    source = tiny_moe_dir("mixtral")
    for file in source.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    weights = tmp_path / "model.safetensors"
    tensors = load_file(weights)
    dropped = next(name for name in tensors if "q_proj" in name)
    del tensors[dropped]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ModelFilesError, match="q_proj"):
        load_without_experts(tmp_path, torch.float32)


def test_a_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(ModelFilesError, match="does not exist"):
        load_without_experts(tmp_path / "nowhere", torch.float32)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    with pytest.raises(ModelFilesError, match="safetensors"):
        load_without_experts(tmp_path / "empty", torch.float32)
