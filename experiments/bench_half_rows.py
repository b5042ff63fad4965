"""Half-precision decode rows on this CPU: what a decoded token's matrix-vector product streams, in
GB/s of weights, for the expert shapes of runs/tw and runs/tb, per torch thread count:

- torch's `linear` on float32 weights (MKL's sgemv) and `rowdot.product` (the "gemv" kernel's);
- torch's `linear` on bfloat16 and on float16 weights (what `--dtype bfloat16` computes with today);
- a bfloat16 row kernel: the "gemv" kernel's dot product per row, each bfloat16 weight widened to
  float32 (its 16 bits shifted up, exact) in blocks that stay in L1, summed in float32. Not in the
  engine: it rounds differently from torch's bfloat16 `linear`, so it would not be bit for bit.

Each case reads `MATRICES` distinct matrices in turn (more than the last-level cache holds), best of
`repeats`; the float32 row kernel and the bfloat16 one are checked against float64 products.

    python -m experiments.bench_half_rows --json results/bench-half-rows.json
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import numba
import numpy as np
import torch

from experiments.machine import machine_info
from offload_runtime.engine import rowdot
from prescient.atomic import write_json_atomic

SHAPES = {"runs/tw gate_up": (44544, 128), "runs/tw down": (128, 22272),
          "runs/tb gate_up": (14848, 128), "runs/tb down": (128, 7424)}
MATRICES = 16
BLOCK = 512  # weights widened at a time: 2 KiB of float32, in L1


@numba.njit(fastmath=True, nogil=True, cache=True)
def _bf16_rows_dot(weight: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    wide = np.empty(BLOCK, np.uint32)
    as_float = wide.view(np.float32)
    for i in range(weight.shape[0]):
        total = np.float32(0.0)
        for start in range(0, weight.shape[1], BLOCK):
            size = min(BLOCK, weight.shape[1] - start)
            bits, part = weight[i, start:start + size], x[start:start + size]  # indices from 0: no wraparound checks
            for j in range(size):
                wide[j] = np.uint32(bits[j]) << 16
            for j in range(size):
                total += as_float[j] * part[j]
        out[i] = total


@numba.njit(fastmath=True, nogil=True, cache=True, parallel=True)
def _bf16_rows_dot_blocks(weight: np.ndarray, x: np.ndarray, out: np.ndarray, blocks: int) -> None:
    step = (weight.shape[0] + blocks - 1) // blocks
    for block in numba.prange(blocks):
        start, stop = block * step, min(weight.shape[0], (block + 1) * step)
        _bf16_rows_dot(weight[start:stop], x, out[start:stop])


def bf16_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x` [1, in] against bfloat16 `weight` [out, in]: [1, out] in float32, on torch's thread count."""
    out = torch.empty(1, weight.shape[0], dtype=torch.float32)
    bits, row = weight.view(torch.int16).numpy().view(np.uint16), x.float().reshape(-1).numpy()
    threads = torch.get_num_threads()
    if threads == 1:
        _bf16_rows_dot(bits, row, out.numpy()[0])
    else:
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        _bf16_rows_dot_blocks(bits, row, out.numpy()[0], threads)
    return out


def _gb_s(call, matrices: list[torch.Tensor], repeats: int) -> float:
    """GB/s of weights read by `call(matrix)` over every matrix in turn, best of `repeats`."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for matrix in matrices:
            call(matrix)
        best = min(best, time.perf_counter() - start)
    return sum(m.numel() * m.element_size() for m in matrices) / best / 1e9


def measure(shape: tuple[int, int], repeats: int) -> dict[str, Any]:
    """Every kernel's GB/s on `MATRICES` random matrices of `shape`, and the row kernels' errors."""
    f32 = [torch.randn(*shape) for _ in range(MATRICES)]
    halves = {dtype: [m.to(dtype) for m in f32] for dtype in (torch.bfloat16, torch.float16)}
    x = torch.randn(1, shape[1]).to(torch.bfloat16).float()  # exact in every dtype measured
    cases = {"float32 linear": (lambda m: torch.nn.functional.linear(x, m), f32),
             "float32 rowdot": (lambda m: rowdot.product(x, m), f32),
             "bfloat16 linear": (lambda m: torch.nn.functional.linear(x.bfloat16(), m), halves[torch.bfloat16]),
             "float16 linear": (lambda m: torch.nn.functional.linear(x.half(), m), halves[torch.float16]),
             "bfloat16 rows": (lambda m: bf16_product(x, m), halves[torch.bfloat16])}
    result = {"gb_s": {name: _gb_s(call, mats, repeats) for name, (call, mats) in cases.items()}}
    for name, call, weight in (("float32 rowdot", rowdot.product, f32[0]),
                               ("bfloat16 rows", bf16_product, halves[torch.bfloat16][0])):
        want = x.double() @ weight.double().t()
        result.setdefault("relative_error", {})[name] = float((call(x, weight).double() - want).abs().max()
                                                              / want.abs().max())
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", required=True, help="results file")
    p.add_argument("--threads", default="1,2", help="torch thread counts, comma-separated")
    p.add_argument("--repeats", type=int, default=7, help="passes over the matrices; the best is kept")
    args = p.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    result: dict[str, Any] = {"command": shlex.join(["python", "-m", "experiments.bench_half_rows",
                                                     *(argv or sys.argv[1:])]),
                              "machine": machine_info(torch.get_num_threads()),
                              "settings": {"shapes": SHAPES, "matrices": MATRICES, "repeats": args.repeats,
                                           "block": BLOCK, "threads": threads}, "runs": {}}
    for count in threads:
        torch.set_num_threads(count)
        for label, shape in SHAPES.items():
            run = measure(shape, args.repeats)
            result["runs"][f"{count} thread(s), {label}"] = run
            print(f"{count} thread(s), {label} {shape}: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in run["gb_s"].items()) + " GB/s")
    write_json_atomic(Path(args.json), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
