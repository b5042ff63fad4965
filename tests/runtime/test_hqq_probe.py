"""experiments.hqq_probe: the asymmetric grid and HQQ's zero-point optimisation it measures."""

from __future__ import annotations

import torch

from experiments.hqq_probe import LP_NORM, asymmetric_rtn, dequantise, hqq_zero


def error(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, p: float) -> float:
    return (w - dequantise(w, scale, zero, bits)).abs().pow(p).sum().item()


def test_asymmetric_grid_spans_each_group_and_rounds_within_half_a_step():
    torch.manual_seed(0)
    weight = torch.randn(8, 128) * torch.linspace(0.1, 2.0, 8).unsqueeze(1)  # rows of different ranges
    w, scale, zero = asymmetric_rtn(weight, 4, 64)
    fake = dequantise(w, scale, zero, 4)
    assert w.shape == fake.shape == (8, 2, 64)
    assert torch.all((fake - w).abs() <= scale / 2 + 1e-6)
    assert torch.allclose(fake.amin(-1), w.amin(-1), atol=1e-5) and torch.allclose(fake.amax(-1), w.amax(-1), atol=1e-5)


def test_hqq_zero_lowers_the_error_of_heavy_tailed_weights():
    torch.manual_seed(0)
    weight = torch.distributions.StudentT(3.0).sample((64, 256))  # outliers stretch each min/max grid
    for bits in (4, 2):
        w, scale, zero = asymmetric_rtn(weight, bits, 64)
        optimised = hqq_zero(w, scale, zero, bits)
        assert optimised.shape == zero.shape
        assert error(w, scale, optimised, bits, LP_NORM) < 0.99 * error(w, scale, zero, bits, LP_NORM)  # its objective
        assert error(w, scale, optimised, bits, 2) < 0.95 * error(w, scale, zero, bits, 2)  # and the squared error
