"""GPTQ experts (`quantize --method gptq`): levels on round-to-nearest's grid that lower the error
on the calibration inputs, written so that plain transformers and the runtime read them, with RTN's
bytes; refused where it cannot run."""

from __future__ import annotations

import json

import pytest
import torch

from offload_runtime.compression.codec import expand_weight, quantize_weight
from offload_runtime.compression.gptq import gptq_weight
from offload_runtime.compression.scheme import weight_args
from offload_runtime.compression.writer import Calibration, quantize_model
from offload_runtime.engine.loader import load_offloaded
from prescient.checkpoint_schemes import CompressionError
from prescient.loading import load_model
from tests.runtime.test_compressed_experts import greedy

ARCHS = ("mixtral", "qwen3_moe", "olmoe")


def correlated_inputs(n: int, width: int, seed: int = 0) -> torch.Tensor:
    """Inputs whose columns are correlated, as a layer's are (what GPTQ exploits)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, width // 4, generator=g) @ torch.randn(width // 4, width, generator=g) \
        + 0.1 * torch.randn(n, width, generator=g)


@pytest.mark.parametrize("bits, group", [(4, 32), (8, None)])
def test_gptq_levels_lie_on_the_rtn_grid_and_lower_the_output_error(bits, group):
    g = torch.Generator().manual_seed(1)
    weight, x = torch.randn(48, 128, generator=g), correlated_inputs(512, 128)
    args = weight_args(bits, group)
    chosen = gptq_weight(weight, x.T @ x, args)
    rtn = expand_weight(quantize_weight(weight, args), args).float()
    # on the grid: packing the chosen weights with the source's scales gives them back
    assert torch.equal(expand_weight(quantize_weight(chosen, args, grid_of=weight), args).float(), chosen)
    assert not torch.equal(chosen, rtn)
    error = lambda w: (x @ (weight - w).T).square().sum()  # noqa: E731 (GPTQ's objective)
    assert error(chosen) < 0.8 * error(rtn)


def test_gptq_with_uncorrelated_inputs_is_round_to_nearest():
    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
    args = weight_args(4, 16)
    rtn = expand_weight(quantize_weight(weight, args), args).float()
    assert torch.equal(gptq_weight(weight, torch.eye(64) * 3.0, args), rtn)


@pytest.mark.parametrize("arch", ARCHS)
def test_gptq_checkpoint_loads_in_transformers_and_the_runtime(arch, tiny_moe_dir, tmp_path):
    source = tiny_moe_dir(arch)
    config = json.loads((source / "config.json").read_text())
    windows = torch.randint(0, config["vocab_size"], (8, 64), generator=torch.Generator().manual_seed(0))
    gptq, rtn = tmp_path / "gptq", tmp_path / "rtn"
    report = quantize_model(source, gptq, 4, method="gptq", calibration=Calibration("random:train", windows))
    quantize_model(source, rtn, 4)
    assert report["method"] == "gptq" and report["calibration"]["windows"] == 8
    assert report["expert_bytes"] == json.loads((rtn / "quantize.json").read_text())["expert_bytes"]
    reference, _ = load_model(source, dtype=torch.float32)
    gptq_model, _ = load_model(gptq, dtype=torch.float32)  # transformers + compressed-tensors, experts expanded
    rtn_model, _ = load_model(rtn, dtype=torch.float32)
    with torch.inference_mode():
        want = reference(windows).logits
        gptq_error = (gptq_model(windows).logits - want).square().mean()
        rtn_error = (rtn_model(windows).logits - want).square().mean()
    assert gptq_error < rtn_error  # on the text it was calibrated on
    offloaded = load_offloaded(gptq, policy="lru", budget="25%")
    with offloaded.runtime:
        assert torch.equal(greedy(offloaded, gptq), greedy(gptq_model, gptq))


def test_gptq_refusals(tiny_moe_dir, tmp_path):
    source = tiny_moe_dir("mixtral")
    windows = torch.zeros(2, 16, dtype=torch.long)
    with pytest.raises(CompressionError, match="needs --bits 2, 4 or 8"):
        quantize_model(source, tmp_path / "a", 16, method="gptq", calibration=Calibration("x", windows))
    with pytest.raises(CompressionError, match="needs calibration text"):
        quantize_model(source, tmp_path / "b", 4, method="gptq")
    with pytest.raises(CompressionError, match="choose one of rtn, gptq"):
        quantize_model(source, tmp_path / "c", 4, method="awq")


def test_inputs_that_were_always_zero_round_to_nearest_and_leave_the_rest_as_without_them():
    """A zero-padded expert (the bench model's widening): GPTQ on the real columns is GPTQ without
    the padding, and the padded columns round to nearest (here: to zero)."""
    g = torch.Generator().manual_seed(3)
    weight, x = torch.randn(16, 64, generator=g), correlated_inputs(256, 64)
    padded = torch.cat([weight, torch.zeros(16, 64)], 1)
    hessian = torch.zeros(128, 128)
    hessian[:64, :64] = x.T @ x
    args = weight_args(4, 32)
    chosen = gptq_weight(padded, hessian, args)
    assert torch.equal(chosen[:, :64], gptq_weight(weight, x.T @ x, args))
    assert torch.equal(chosen[:, 64:], torch.zeros(16, 64))
    # what gptq_experts hands it for a padded expert: the Hessian of the weighted columns only
    assert torch.equal(gptq_weight(padded, x.T @ x, args, columns=torch.arange(64)), chosen)
