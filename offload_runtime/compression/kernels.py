"""Experts that stay compressed in the fast tier and compute with torch's weight-only CPU kernels.

Two kernels multiply bf16 activations by a compressed weight [N, K] without expanding it:

- int4, group-wise: `torch._weight_int4pack_mm_for_cpu(x, packed, group, scales_zeros)`, the
  weight as `packed` (uint8 [N, K/2], in a layout of its own) and `scales_zeros` ([K/group, N, 2]
  bf16: each group's scale, and an offset we keep at zero); it computes w = (code - 8) * scale +
  offset from the unsigned 4-bit code. compressed-tensors stores a symmetric int4 level as the
  same unsigned code (level + 8), so a stored expert becomes a kernel operand by re-arranging its
  codes, never by rounding anything again.
- int8, per output channel: `torch._weight_int8pack_mm(x, weight, scales)`, the weight as int8
  [N, K] and one bf16 scale per row. compressed-tensors stores level + 128 unsigned; flipping the
  top bit gives the two's-complement level.

The int4 layout is the CPU's run-time layout, not a file format: with AVX-512 torch packs rows
in blocks of 64, code of row i in the low nibble and of row i + 32 in the high one, k-major
within the block. We re-arrange the stored bytes (two codes of one row per byte, lowest first) that
way directly (a compiled loop over the bytes), when a probe checked at first use shows this torch
packs that way on this CPU, and otherwise hand the unpacked codes to torch's own converter.

A packed slot holds, per weight parameter P [N, K] of the experts module, `P` (the codes) and
`P` + SCALES_SUFFIX (the scales). `PackedWeights` stands in for P's [S, N, K] parameter in the
experts module's twin: indexing it gives one slot's matrix, and `F.linear(x, matrix)` (what
transformers' eager expert loop calls) runs the kernel, through torch's `__torch_function__`
protocol, so the model's own expert code runs unchanged.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

import numba
import numpy as np
import torch
import torch.nn.functional as F

from offload_runtime.compression.codec import unpack_codes
from prescient.checkpoint_schemes import CompressionError

SCALES_SUFFIX = "_scales"
INT4_GROUPS = (32, 64, 128, 256)  # the group sizes torch's CPU int4 kernel accepts
KERNEL_DTYPE = torch.bfloat16  # the kernels' activations and scales
INT2_TO_INT4 = 6  # a stored 2-bit code is level + 2, an int4 one level + 8


@dataclass(frozen=True)
class PackedMatrixSpec:
    """One weight parameter of an expert kept packed: [out_features, in_features] at `bits` (4:
    in groups of `group` along a row; 8: one scale per row, `group` None). `stored_bits`: the
    width on disk and on the link where it is narrower than the slot's (2-bit weights, whose levels
    the int4 kernel runs on arrival)."""

    bits: int
    out_features: int
    in_features: int
    group: int | None = None
    stored_bits: int | None = None

    @property
    def link_bits(self) -> int:
        """Bits per weight as stored and moved."""
        return self.stored_bits or self.bits

    def slot_tensors(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The slot's tensors of this parameter, by suffix after its name: shape and dtype."""
        n, k = self.out_features, self.in_features
        if self.bits == 4:
            return {"": ((n, k // 2), torch.uint8), SCALES_SUFFIX: ((k // self.group, n, 2), KERNEL_DTYPE)}
        return {"": ((n, k), torch.int8), SCALES_SUFFIX: ((n,), KERNEL_DTYPE)}

    def check(self, what: str) -> None:
        """A CompressionError naming `what` unless a kernel can run this matrix."""
        if self.bits == 4 and (self.group not in INT4_GROUPS or self.in_features % self.group):
            raise CompressionError(f"{what}: torch's int4 kernel takes groups of {', '.join(map(str, INT4_GROUPS))} "
                                   f"along the input dimension, not {self.group} (in_features {self.in_features}); "
                                   "quantize with --group-size 32, 64 or 128, or keep --slot-format expanded")


def kernel_matrix(bits: int, symmetric: bool, strategy: str, group: int | None, shape: tuple[int, ...],
                  what: str) -> PackedMatrixSpec:
    """The packed matrix of a weight of `shape` stored at these quantisation arguments; a
    CompressionError naming `what` if no kernel runs it."""
    if not symmetric or (bits, strategy) not in ((2, "group"), (4, "group"), (8, "channel")):
        raise CompressionError(f"{what} is stored as {bits}-bit {strategy}-wise {'' if symmetric else 'a'}symmetric "
                               "weights; packed slots hold symmetric int4 or int2 in groups (prescient quantize --bits "
                               "4 or 2) or int8 per channel (--bits 8 --group-size channel); serve it with "
                               "--slot-format expanded")
    matrix = PackedMatrixSpec(8, shape[0], shape[1]) if bits == 8 else \
        PackedMatrixSpec(4, shape[0], shape[1], group, stored_bits=2 if bits == 2 else None)
    matrix.check(what)
    return matrix


@functools.cache
def _block_rows() -> int | None:
    """The row block of torch's CPU int4 layout as we re-arrange bytes (64 or 32 rows), if a
    random probe arranged that way equals torch's converter on this CPU; None: use the converter."""
    generator = torch.Generator().manual_seed(0)
    stored = torch.randint(0, 256, (128, 32), dtype=torch.uint8, generator=generator)
    expected = torch._convert_weight_to_int4pack_for_cpu(unpack_codes(stored, 4, 128, 64).to(torch.int32), 1)
    for rows in (64, 32):
        if torch.equal(_arrange(stored, rows), expected):
            return rows
    return None


@numba.njit(cache=True, nogil=True)
def _arrange_int4(stored: np.ndarray, rows: int, out: np.ndarray) -> None:
    """Stored int4 bytes [N, K/2] (codes of columns 2j and 2j+1 of a row in byte j, lowest first;
    N a multiple of `rows`) into `out` [N, K/2] in blocks of `rows` rows: row i's code in the low
    nibble and row i + rows/2's in the high one, k-major within the block (a block's bytes in the
    order (column, row))."""
    n, half = stored.shape
    pair = rows // 2
    for block in range(n // rows):
        first = block * rows
        arranged = out[first:first + rows].reshape(-1)
        for r in range(pair):
            low, high = stored[first + r], stored[first + pair + r]
            for j in range(half):
                arranged[2 * j * pair + r] = (low[j] & 15) | ((high[j] & 15) << 4)  # column 2j
                arranged[(2 * j + 1) * pair + r] = (low[j] >> 4) | (high[j] & 0xF0)  # column 2j + 1


@functools.cache
def _int2_pairs() -> np.ndarray:
    """[65536] uint32, indexed by a 2-bit stored byte of row i (low 8 bits) and the same byte of
    row i + rows/2 (high 8 bits): the four arranged int4 bytes of their four columns, column t in
    bits 8t to 8t + 7, row i's level + 8 in the low nibble and the other row's in the high one."""
    index = np.arange(1 << 16, dtype=np.uint32)
    out = np.zeros(1 << 16, dtype=np.uint32)
    for t in range(4):
        low, high = ((index >> 2 * t) & 3) + INT2_TO_INT4, ((index >> 8 + 2 * t) & 3) + INT2_TO_INT4
        out |= (low | high << 4) << 8 * t
    return out


@numba.njit(cache=True, nogil=True)
def _arrange_int2(stored: np.ndarray, rows: int, pairs: np.ndarray, out: np.ndarray) -> None:
    """`_arrange_int4` of 2-bit stored bytes [N, K/4] (four codes a byte, lowest first), re-coded
    to int4 on the way by one look-up in `pairs` (`_int2_pairs`) per pair of stored bytes; `out`
    is [N, K/2]."""
    n, quarter = stored.shape
    pair = rows // 2
    for block in range(n // rows):
        first = block * rows
        arranged = out[first:first + rows].reshape(-1)
        for r in range(pair):
            low, high = stored[first + r], stored[first + pair + r]
            for j in range(quarter):
                four = pairs[np.int32(low[j]) | (np.int32(high[j]) << 8)]
                for t in range(4):
                    arranged[(4 * j + t) * pair + r] = (four >> (8 * t)) & 255


def _arrange(stored: torch.Tensor, rows: int, stored_bits: int = 4, out: torch.Tensor | None = None) -> torch.Tensor:
    """Stored int4 ([N, K/2] bytes) or int2 ([N, K/4]) codes arranged as torch's CPU int4 kernel
    packs int4 codes in blocks of `rows` rows, into contiguous uint8 `out` [N, K/2] (new if None).
    Compiled, and without the GIL: it runs on a transfer thread beside the inference thread."""
    if out is None:
        out = torch.empty(stored.shape[0], stored.shape[1] * 4 // stored_bits, dtype=torch.uint8)
    if not out.is_contiguous():
        raise ValueError("arranged int4 codes are written into a contiguous tensor")
    source, target = stored.contiguous().numpy(), out.numpy()
    if stored_bits == 2:
        _arrange_int2(source, rows, _int2_pairs(), target)
    else:
        _arrange_int4(source, rows, target)
    return out


def pack_for_kernel(matrix: PackedMatrixSpec, stored: torch.Tensor, scale: torch.Tensor, codes: torch.Tensor,
                    scales: torch.Tensor) -> None:
    """Write a weight as compressed-tensors stores it (uint8 [N, K * bits / 8]: unsigned codes,
    lowest bits first) and its scales [N, groups] into a slot's `codes` and `scales`."""
    if matrix.bits == 8:
        codes.copy_(stored.bitwise_xor(0x80).view(torch.int8))
        scales.copy_(scale[:, 0])
        return
    rows = _block_rows()
    if rows is None or stored.shape[0] % rows:  # torch's converter, from the int4 codes
        levels = unpack_codes(stored, matrix.link_bits, stored.shape[0], matrix.in_features).to(torch.int32)
        if matrix.stored_bits == 2:
            levels += INT2_TO_INT4
        codes.copy_(torch._convert_weight_to_int4pack_for_cpu(levels, 1))
    else:
        _arrange(stored, rows, matrix.stored_bits, out=codes)
    scales[..., 0].copy_(scale.t())
    scales[..., 1].zero_()


class PackedWeights:
    """The [S, N, K] weight parameter of an experts module over S packed slots; `weights[slot]`
    is one slot's matrix, which `F.linear` multiplies with the kernel. The slots may come in
    tiers of different formats (mixed precision: int8 slots, then int4 ones), each tier its
    `(codes, scales, spec)`, numbered one tier after another."""

    def __init__(self, tiers: list[tuple[torch.Tensor, torch.Tensor, PackedMatrixSpec]]) -> None:
        self.tiers = tiers
        self.starts = [sum(len(codes) for codes, _, _ in tiers[:i]) for i in range(len(tiers))]

    def __getitem__(self, slot: int | torch.Tensor) -> "PackedMatrix":
        slot = int(slot)
        tier = bisect.bisect_right(self.starts, slot) - 1
        codes, scales, spec = self.tiers[tier]
        return PackedMatrix(codes[slot - self.starts[tier]], scales[slot - self.starts[tier]], spec)


class PackedMatrix:
    """One slot's packed matrix [N, K]; `F.linear(x, it)` is x @ W.T on bf16 activations."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, spec: PackedMatrixSpec) -> None:
        self.codes, self.scales, self.spec = codes, scales, spec

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != KERNEL_DTYPE:
            raise CompressionError(f"packed experts compute on {KERNEL_DTYPE} activations, got {x.dtype}; "
                                   "serve with --dtype bfloat16")
        flat = x.reshape(-1, self.spec.in_features).contiguous()
        if self.spec.bits == 4:
            out = torch._weight_int4pack_mm_for_cpu(flat, self.codes, self.spec.group, self.scales)
        else:
            out = torch._weight_int8pack_mm(flat, self.codes, self.scales)
        return out.view(*x.shape[:-1], self.spec.out_features)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if isinstance(weight, cls) and not isinstance(x, cls) and bias is None:
                return weight.linear(x)
        raise CompressionError(f"packed experts run only as F.linear(x, weight) without bias, as transformers' "
                               f"eager experts call them; this experts module calls {getattr(func, '__name__', func)}. "
                               "Serve it with --slot-format expanded")
