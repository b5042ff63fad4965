"""Experts that stay int4 in the fast tier and compute with torch's int4 weight-only CPU kernel.

`torch._weight_int4pack_mm_for_cpu(x, packed, group, scales_zeros)` multiplies bf16 activations
by an int4 weight [N, K] held as `packed` (uint8 [N, K/2], in a layout of its own) and
`scales_zeros` ([K/group, N, 2] bf16: each group's scale, and an offset we keep at zero); it
computes w = (code - 8) * scale + offset, where code is the unsigned 4-bit code. compressed-tensors
stores a symmetric int4 level as the same unsigned code (level + 8), so a stored expert becomes a
kernel operand by re-arranging its codes, never by rounding anything again.

The packed layout is the CPU's run-time layout, not a file format: with AVX-512 torch packs rows
in blocks of 64, code of row i in the low nibble and of row i + 32 in the high one, k-major
within the block. We re-arrange the stored bytes (two codes of one row per byte, lowest first) that
way directly, a few byte-wise operations, when a probe checked at first use shows this torch
packs that way on this CPU, and otherwise hand the unpacked codes to torch's own converter.

A slot of a packed expert holds, per weight parameter P [N, K] of the experts module, `P`
(packed codes) and `P` + SCALES_SUFFIX (scales_zeros). `PackedInt4Weights` stands in for P's
[S, N, K] parameter in the experts module's twin: indexing it gives one slot's matrix, and
`F.linear(x, matrix)` (what transformers' eager expert loop calls) runs the kernel, through
torch's `__torch_function__` protocol, so the model's own expert code runs unchanged.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from offload_runtime.compression.codec import unpack_codes
from offload_runtime.compression.scheme import CompressionError

SCALES_SUFFIX = "_scales_zeros"
KERNEL_GROUPS = (32, 64, 128, 256)  # the group sizes torch's CPU int4 kernel accepts
KERNEL_DTYPE = torch.bfloat16  # its activations and scales


@dataclass(frozen=True)
class PackedMatrixSpec:
    """One weight parameter of an expert kept packed: [out_features, in_features] in groups of `group`."""

    out_features: int
    in_features: int
    group: int

    def shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """The slot shapes of its packed codes and of its scales_zeros."""
        return (self.out_features, self.in_features // 2), (self.in_features // self.group, self.out_features, 2)

    def check(self, what: str) -> None:
        """A CompressionError naming `what` unless the kernel can run this matrix."""
        if self.group not in KERNEL_GROUPS or self.in_features % self.group:
            raise CompressionError(f"{what}: torch's int4 kernel takes groups of {', '.join(map(str, KERNEL_GROUPS))} "
                                   f"along the input dimension, not {self.group} (in_features {self.in_features}); "
                                   "quantize with --group-size 32, 64 or 128, or keep --slot-format expanded")


@functools.cache
def _block_rows() -> int | None:
    """The row block of torch's CPU packed layout as we re-arrange bytes (64 or 32 rows), if a
    random probe arranged that way equals torch's converter on this CPU; None: use the converter."""
    generator = torch.Generator().manual_seed(0)
    stored = torch.randint(0, 256, (128, 32), dtype=torch.uint8, generator=generator)
    expected = torch._convert_weight_to_int4pack_for_cpu(unpack_codes(stored, 4, 128, 64).to(torch.int32), 1)
    for rows in (64, 32):
        if torch.equal(_arrange(stored, rows), expected):
            return rows
    return None


def _arrange(stored: torch.Tensor, rows: int) -> torch.Tensor:
    """Stored bytes [N, K/2] (codes of columns 2j and 2j+1 of a row in byte j, lowest first; N a
    multiple of `rows`) in blocks of `rows` rows, row i's code in the low nibble and row
    i + rows/2's in the high one, k-major within the block: [N, K/2] bytes."""
    n, half = stored.shape
    low, high = stored.view(n // rows, 2, rows // 2, half).unbind(1)  # each [blocks, rows/2, K/2]
    out = torch.empty(n // rows, half, 2, rows // 2, dtype=torch.uint8)
    out[:, :, 0] = torch.bitwise_or(low & 15, (high & 15) << 4).transpose(1, 2)  # even columns
    out[:, :, 1] = torch.bitwise_or(low >> 4, high & 0xF0).transpose(1, 2)  # odd columns
    return out.view(n, half)


def pack_for_kernel(stored: torch.Tensor, scale: torch.Tensor, packed: torch.Tensor,
                    scales_zeros: torch.Tensor) -> None:
    """Write an int4 weight [N, K] as compressed-tensors stores it (uint8 [N, K/2], two unsigned
    codes per byte, lowest first) and its group scales [N, K/group] into a slot's `packed`
    [N, K/2] and `scales_zeros` [K/group, N, 2]."""
    rows = _block_rows()
    if rows is not None and stored.shape[0] % rows == 0:
        packed.copy_(_arrange(stored, rows))
    else:
        codes = unpack_codes(stored, 4, stored.shape[0], 2 * stored.shape[1])
        packed.copy_(torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1))
    scales_zeros[..., 0].copy_(scale.t())
    scales_zeros[..., 1].zero_()


class PackedInt4Weights:
    """The [S, N, K] weight parameter of an experts module over S slots of packed int4 experts;
    `weights[slot]` is one slot's matrix, which `F.linear` multiplies with the kernel."""

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, spec: PackedMatrixSpec) -> None:
        self.packed, self.scales_zeros, self.spec = packed, scales_zeros, spec

    def __getitem__(self, slot: int | torch.Tensor) -> "PackedInt4Matrix":
        return PackedInt4Matrix(self.packed[slot], self.scales_zeros[slot], self.spec)

    def __len__(self) -> int:
        return self.packed.shape[0]


class PackedInt4Matrix:
    """One slot's packed int4 matrix [N, K]; `F.linear(x, it)` is x @ W.T on bf16 activations."""

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, spec: PackedMatrixSpec) -> None:
        self.packed, self.scales_zeros, self.spec = packed, scales_zeros, spec

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.spec.out_features, self.spec.in_features))

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != KERNEL_DTYPE:
            raise CompressionError(f"packed int4 experts compute on {KERNEL_DTYPE} activations, got {x.dtype}; "
                                   "serve with --dtype bfloat16")
        flat = x.reshape(-1, self.spec.in_features)
        out = torch._weight_int4pack_mm_for_cpu(flat.contiguous(), self.packed, self.spec.group, self.scales_zeros)
        return out.view(*x.shape[:-1], self.spec.out_features)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if isinstance(weight, cls) and not isinstance(x, cls) and bias is None:
                return weight.linear(x)
        raise CompressionError(f"packed int4 experts run only as F.linear(x, weight) without bias, as transformers' "
                               f"eager experts call them; this experts module calls {getattr(func, '__name__', func)}. "
                               "Serve it with --slot-format expanded")
