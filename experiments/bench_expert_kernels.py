"""What one expert costs on this CPU at each stored precision: the two placements of compressed
experts side by side, per matrix of a model's experts.

- expanded on arrival (`--slot-format expanded`): milliseconds to expand the stored parts into a
  float32 (or bfloat16) matrix, then a float32 / bfloat16 `F.linear` per token;
- packed in the fast tier (`--slot-format packed`): milliseconds to arrange the stored parts into
  the kernel's operands once per load (`kernels.pack_for_kernel`, int4 in groups, int8 per
  channel), then the slot's matrix through `F.linear`, i.e. `torch._weight_int4pack_mm_for_cpu`
  / `torch._weight_int8pack_mm` on bfloat16 activations, per token.

    python -m experiments.bench_expert_kernels --model DIR --json OUT.json [--threads 1]

Timed with `torch.utils.benchmark.Timer.blocked_autorange` (median of its blocks), one thread by
default, batch 1. The matrices are layer 0 expert 0's, as the model's checkpoint shapes them.
JSON: {machine, model, matrices: {name: {shape, group_size, fp32_linear_ms, bf16_linear_ms,
int4: {stored_bytes, expand_fp32_ms, expand_bf16_ms, repack_ms, kernel_ms}, int8: {... per channel}}}}.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.benchmark import Timer

from experiments.machine import machine_info
from offload_runtime.compression.codec import expand_into, quantize_weight
from offload_runtime.compression.kernels import PackedWeights, kernel_matrix, pack_for_kernel
from offload_runtime.compression.scheme import weight_args
from offload_runtime.compression.writer import GROUP_SIZES, expert_keys
from prescient.atomic import write_json_atomic
from prescient.model_dir import ModelDirectory


def _ms(fn) -> float:
    return round(Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=0.5).median * 1e3, 4)


def _packed(parts: dict[str, torch.Tensor], bits: int, group: int | None, shape: tuple[int, int]):
    """A packed slot of the stored `parts`: the arrangement (timed as a load's cost) and the
    kernel through `F.linear` on bf16 activations."""
    matrix = kernel_matrix(bits, True, "group" if group else "channel", group, shape, "bench matrix")
    slot = [torch.empty(1, *s, dtype=d) for s, d in matrix.slot_tensors().values()]
    stored, scale = parts["weight_packed"].view(torch.uint8), parts["weight_scale"]
    arrange = lambda: pack_for_kernel(matrix, stored, scale, slot[0][0], slot[1][0])  # noqa: E731
    arrange()
    weight, x = PackedWeights([(*slot, matrix)])[0], torch.randn(1, shape[1], dtype=torch.bfloat16)
    return arrange, lambda: F.linear(x, weight)


def measure(model_dir: Path, threads: int) -> dict:
    from safetensors import safe_open

    torch.set_num_threads(threads)
    keys = expert_keys(ModelDirectory.open(model_dir))
    zero = [k for k in keys if re.search(r"experts\.0\.", k)]
    layer = min(int(re.search(r"\d+", k).group()) for k in zero)
    first = sorted(k for k in zero if int(re.search(r"\d+", k).group()) == layer)  # expert 0 of the first layer
    matrices = {}
    for key in first:
        with safe_open(str(keys[key]), framework="pt") as handle:
            weight = handle.get_tensor(key).float()
        rows, cols = weight.shape
        group = next(g for g in GROUP_SIZES if cols % g == 0)
        x32, x16 = torch.randn(1, cols), torch.randn(1, cols, dtype=torch.bfloat16)
        w16 = weight.to(torch.bfloat16)
        row = {"shape": [rows, cols], "group_size": group, "fp32_bytes": weight.numel() * 4,
               "fp32_linear_ms": _ms(lambda: F.linear(x32, weight)), "bf16_linear_ms": _ms(lambda: F.linear(x16, w16))}
        for bits in (4, 8):
            args = weight_args(bits, group if bits == 4 else None)  # int8: per channel, what its kernel takes
            parts = quantize_weight(weight, args)
            into32, into16 = torch.empty(rows, cols), torch.empty(rows, cols, dtype=torch.bfloat16)
            figures = {"stored_bytes": sum(t.numel() * t.element_size() for n, t in parts.items() if n != "weight_shape"),
                       "expand_fp32_ms": _ms(lambda: expand_into(parts, args, into32)),
                       "expand_bf16_ms": _ms(lambda: expand_into(parts, args, into16))}
            arrange, kernel = _packed(parts, bits, args.group_size, (rows, cols))
            figures.update(repack_ms=_ms(arrange), kernel_ms=_ms(kernel))
            row[f"int{bits}"] = figures
        matrices[key] = row
    return {"machine": machine_info(threads), "model": str(model_dir), "matrices": matrices}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--json", required=True)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    write_json_atomic(args.json, measure(Path(args.model), args.threads))


if __name__ == "__main__":
    main()
