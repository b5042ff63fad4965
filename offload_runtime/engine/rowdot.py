"""One decode row against one expert matrix at the memory bus's rate: the "gemv" kernel's product.

A decoded token multiplies one row by each routed expert's [out, in] matrices, reading every
weight once: a matrix-vector product, bound by how fast memory streams the matrix. torch's
`linear` (MKL's sgemv) streams this project's wide experts far below the bus on its AMD CPU; a
plain dot product per row, compiled by numba for the host CPU (`fastmath`: the sum vectorised and
reassociated), streams near it: on runs/tw a decode token's experts at 35 GB/s on one core against
a 41 GB/s read pass, 67 against 79 on two (torch's own kernel: 13), results/bench-decode-tw-rowdot.json.
With more torch threads the rows are split in contiguous blocks, one per thread, each block the
same one-thread loop: a row's sum does not depend on the thread count. Its sums run in another
order than torch's, so its results differ from grouped_mm's in the last bits (the plain model's
logits within 1e-5, its greedy tokens: the tests check).

Only float32 CPU matrices of at least `LEAST_BYTES` run here (`streams`): a smaller one comes from
the cache, where torch's `linear` costs no more and rounds as the model does.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

# a matrix smaller than this (one core's L2 on this project's AMD CPU) is read from the cache, where
# the call's own work decides and torch's `linear` is as fast (the demo model's 256 and 128 KiB matrices)
LEAST_BYTES = 2**20
# what the kernels hold beyond their output: numba's compiled code and its threads' pool (numba and its
# compiler are loaded by the runtime already); under this in a profile of a first decode, where numba
# compiled them; the memory plan books it (`expert_kernels.kernel_workspace_bytes`)
WORKSPACE = 8 * 2**20


@numba.njit(fastmath=True, nogil=True, cache=True)
def _rows_dot(weight: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    for i in range(weight.shape[0]):
        total = np.float32(0.0)
        for j in range(weight.shape[1]):
            total += weight[i, j] * x[j]
        out[i] = total


@numba.njit(fastmath=True, nogil=True, cache=True, parallel=True)
def _rows_dot_blocks(weight: np.ndarray, x: np.ndarray, out: np.ndarray, blocks: int) -> None:
    step = (weight.shape[0] + blocks - 1) // blocks
    for block in numba.prange(blocks):
        start, stop = block * step, min(weight.shape[0], (block + 1) * step)
        _rows_dot(weight[start:stop], x, out[start:stop])


def streams(weight: torch.Tensor) -> bool:
    """Whether a row against `weight` ([out, in]) runs `product`: float32 on the CPU, contiguous and
    aligned to its element (as numba reads it), at least `LEAST_BYTES`."""
    return (weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2
            and weight.is_contiguous() and weight.data_ptr() % 4 == 0
            and weight.numel() * weight.element_size() >= LEAST_BYTES)


def product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x` [1, in] (float32) against `weight` [out, in] (`streams` holds): [1, out], what `linear`
    computes, on torch's thread count."""
    out = torch.empty(1, weight.shape[0], dtype=torch.float32)
    rows_product(weight.detach().numpy(), x.detach().reshape(-1).contiguous().numpy(), out.numpy()[0],
                 torch.get_num_threads())
    return out


def rows_product(weight: np.ndarray, row: np.ndarray, out: np.ndarray, threads: int) -> None:
    """`product` on arrays: `row` [in] against `weight` [out, in] into `out` [out], split over
    `threads` blocks of rows where more than one."""
    if threads == 1:
        _rows_dot(weight, row, out)
        return
    wanted = min(threads, numba.config.NUMBA_NUM_THREADS)
    if numba.get_num_threads() != wanted:  # numba's count is per calling thread
        numba.set_num_threads(wanted)
    _rows_dot_blocks(weight, row, out, threads)
