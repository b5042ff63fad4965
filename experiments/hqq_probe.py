"""Would HQQ's optimiser earn a place beside GPTQ in `prescient quantize`? A probe, not a method.

HQQ (Badri & Shaji, "Half-Quadratic Quantization of Large Machine Learning Models", 2023) keeps
each group's min/max scale and optimises its zero point so that the quantisation error is sparse
(an l_p "norm", p < 1), by half-quadratic splitting, without calibration data. It needs zero
points (asymmetric groups), which our writer, codec and packed slots do not carry; so instead of
building that path first, this probe writes *fake-quantised* copies of a model (every routed
expert weight replaced by its dequantised asymmetric-RTN or HQQ levels, the rest untouched) that
`prescient quality` then measures beside the real RTN and GPTQ checkpoints:

    python -m experiments.hqq_probe --model runs/reference-bench-base --bits 4 --group-size 64 \\
        --out runs/hqq-probe --json results/hqq-probe-base-w4g64.json
    prescient quality --model runs/hqq-probe/hqq-w4g64 --reference runs/reference-bench-base --windows 64 \\
        --json results/quality-base-hqq-w4g64.json

The JSON holds, per method, the relative Frobenius error of the expert weights (all layers).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from prescient.arch import find_moe_layers

# HQQ's published defaults for weights (hqq.core.optimize.optimize_weights_proximal)
LP_NORM, BETA, KAPPA, ITERS = 0.7, 10.0, 1.01, 20


def _groups(weight: torch.Tensor, group: int) -> torch.Tensor:
    """[..., K] → [..., K / group, group] (groups along the input dimension, as the writer's)."""
    return weight.reshape(*weight.shape[:-1], weight.shape[-1] // group, group)


def asymmetric_rtn(weight: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each group's min/max grid: scale (max - min) / (2^b - 1), zero -min / scale (unrounded, as HQQ)."""
    w = _groups(weight, group)
    low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale = ((high - low) / (2**bits - 1)).clamp_min(1e-8)
    return w, scale, -low / scale


def dequantise(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    return (torch.round(w / scale + zero).clamp(0, 2**bits - 1) - zero) * scale


def hqq_zero(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """HQQ's proximal zero-point optimisation: W_e = shrink_p(W - dequant(W)), then the zero
    that best explains W - W_e, with the penalty's weight beta growing by kappa each step; keeps
    the best zero by the l_p error."""
    beta, best, best_error = BETA, zero, float("inf")
    for _ in range(ITERS):
        levels = torch.round(w / scale + zero).clamp(0, 2**bits - 1)
        residual = w - (levels - zero) * scale
        error = residual.abs().pow(LP_NORM).sum().item()
        if error < best_error:
            best, best_error = zero, error
        magnitude = residual.abs()
        sparse = torch.sign(residual) * torch.relu(magnitude - magnitude.clamp_min(1e-12).pow(LP_NORM - 1) / beta)
        zero = (levels - (w - sparse) / scale).mean(-1, keepdim=True)
        beta *= KAPPA
    return best


def probe(model_dir: str, bits: int, group: int, out: Path) -> dict:
    report = {"model": model_dir, "bits": bits, "group_size": group, "hqq": {"lp_norm": LP_NORM, "beta": BETA,
                                                                           "kappa": KAPPA, "iters": ITERS},
              "methods": {}}
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for method in ("asym-rtn", "hqq"):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        error, total = 0.0, 0.0
        params = [p for layer in find_moe_layers(model) for p in layer.experts.parameters() if p.dim() == 3]
        for param in tqdm(params, desc=method, unit="matrix"):
            w, scale, zero = asymmetric_rtn(param.data, bits, group)
            if method == "hqq":
                zero = hqq_zero(w, scale, zero, bits)
            fake = dequantise(w, scale, zero, bits).reshape(param.shape)
            error += (fake - param.data).pow(2).sum().item()
            total += param.data.pow(2).sum().item()
            param.data.copy_(fake)
        target = out / f"{method}-w{bits}g{group}"
        model.save_pretrained(target)
        tokenizer.save_pretrained(target)
        report["methods"][method] = {"dir": str(target), "relative_frobenius_error": (error / total) ** 0.5}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--bits", type=int, choices=(2, 4), default=4)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--json", required=True, type=Path)
    args = parser.parse_args()
    report = probe(args.model, args.bits, args.group_size, args.out)
    args.json.write_text(json.dumps(report, indent=2))
    print(json.dumps(report["methods"], indent=2))


if __name__ == "__main__":
    main()
