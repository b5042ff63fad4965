"""One weight [out, in] quantised group-wise and expanded again, through compressed-tensors' own
`pack-quantized` compressor, so that what we write is what its readers (transformers, vLLM) read
and what we read is what they would compute.

Scales are stored in bfloat16, as llm-compressor writes them for bf16 checkpoints; the library
expands a weight in its scale's dtype, so an expanded expert holds bf16 values whatever dtype the
model computes in (transformers' own loader gives the same values).
"""

from __future__ import annotations

import math

import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.utils import calculate_qparams

from prescient.checkpoint_schemes import CompressionError

SCALE_DTYPE = torch.bfloat16
STORED_BITS = (2, 4, 8)  # the widths `unpack_codes` reads: whole codes per byte


def _scheme(args: QuantizationArgs) -> QuantizationScheme:
    return QuantizationScheme(targets=["Linear"], weights=args)


def group_scales(weight: torch.Tensor, args: QuantizationArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest's grid for `weight` [out, in]: (scale, zero point) [out, groups] from each
    group's min/max, the scale rounded to its stored dtype."""
    w = weight.detach().float()
    size = args.group_size if args.strategy == "group" else w.shape[1]
    if w.dim() != 2 or w.shape[1] % size:
        raise ValueError(f"weight {list(w.shape)} does not split into groups of {size} along its input dimension")
    groups = w.reshape(w.shape[0], -1, size)
    scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
    return scale.to(SCALE_DTYPE), zero


def quantize_weight(weight: torch.Tensor, args: QuantizationArgs,
                    grid_of: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """`weight` [out, in] rounded to the nearest level of its group's grid (min/max scales of
    `grid_of`, default the weight itself; GPTQ hands its chosen weights with the source's grid):
    `weight_packed` (int32), `weight_scale`, `weight_shape`, and for an asymmetric scheme
    `weight_zero_point`, as the checkpoint stores them under the module's name."""
    scale, zero = group_scales(weight if grid_of is None else grid_of, args)
    state = {"weight": weight.detach().float(), "weight_scale": scale, "weight_zero_point": zero}
    return {name: t.contiguous() for name, t in PackedQuantizationCompressor.compress(state, _scheme(args)).items()}


def expand_weight(tensors: dict[str, torch.Tensor], args: QuantizationArgs) -> torch.Tensor:
    """The weight [out, in] that the compressed `tensors` of one module hold (in the scale's dtype)."""
    return PackedQuantizationCompressor.decompress(tensors, _scheme(args))["weight"]


def expand_into(tensors: dict[str, torch.Tensor], args: QuantizationArgs, out: torch.Tensor) -> torch.Tensor:
    """`expand_weight` written into `out` [out, in] (any float dtype): the same values. Symmetric
    2-, 4- and 8-bit weights, what `prescient quantize` writes, take a path of their own, since a
    miss pays for it (a prototype, not kept: 1.3 ms against the library's 55 ms for a 7424x192
    int4 matrix on one thread; results/expert-kernels-bench.json keeps this path's 1.04-1.07 ms):
    the levels are read byte-wise (`unpack_codes`) and multiplied by their group's scale in the
    scale's dtype, as the library multiplies them."""
    if not (args.symmetric and args.num_bits in STORED_BITS and args.strategy in ("group", "channel")):
        return out.copy_(expand_weight({**tensors, "weight_shape": torch.tensor(out.shape)}, args))
    scale = tensors["weight_scale"]
    rows, cols = out.shape
    levels = unpack_codes(tensors["weight_packed"], args.num_bits, rows, cols).to(scale.dtype)
    levels -= 1 << (args.num_bits - 1)  # stored unsigned: level + 2^(bits-1)
    levels = levels.view(rows, scale.shape[1], -1)
    return out.copy_(levels.mul_(scale.unsqueeze(-1)).view(rows, cols))


def unpack_codes(packed: torch.Tensor, num_bits: int, rows: int, cols: int) -> torch.Tensor:
    """The stored unsigned codes (level + 2^(bits-1)) of a symmetric 2-, 4- or 8-bit `weight_packed`
    [rows, words] as uint8 [rows, cols]: 8 / bits codes per byte, lowest bits first (the library
    packs a dense little-endian bit stream, so no code straddles a byte at these widths)."""
    codes = packed.view(torch.uint8).view(rows, -1)
    if num_bits == 8:
        return codes[:, :cols]
    per_byte, mask = 8 // num_bits, (1 << num_bits) - 1
    out = torch.empty(rows, codes.shape[1], per_byte, dtype=torch.uint8)
    for i in range(per_byte):
        torch.bitwise_and(torch.bitwise_right_shift(codes, i * num_bits), mask, out=out[..., i])
    return out.view(rows, -1)[:, :cols]


def compressed_names(args: QuantizationArgs) -> tuple[str, ...]:
    """The checkpoint tensors of one compressed weight, by their name after the module's."""
    return PackedQuantizationCompressor.compression_param_names(_scheme(args))


def check_parts(what: str, shape: tuple[int, ...], scale: torch.Tensor, packed_shape: tuple[int, ...],
                args: QuantizationArgs) -> None:
    """A CompressionError naming `what` unless a weight of `shape` stored at `args` has scales of
    the shape its groups need, all finite, and a packed tensor of the size its levels need."""
    groups = 1 if args.strategy == "channel" else (shape[-1] // args.group_size if len(shape) == 2 else 0)
    if len(shape) != 2 or tuple(scale.shape) != (shape[0], groups):
        raise CompressionError(f"{what}.weight_scale has shape {list(scale.shape)}, but a {list(shape)} weight in "
                               f"{args.strategy}s of {args.group_size} needs [{shape[0] if shape else '?'}, {groups}]")
    if not torch.isfinite(scale.float()).all():
        raise CompressionError(f"{what}.weight_scale holds NaN or infinite values; the checkpoint is damaged")
    needed = (shape[0], math.ceil(shape[1] * args.num_bits / 32))
    if tuple(packed_shape) != needed:
        raise CompressionError(f"{what}.weight_packed has shape {list(packed_shape)}, a {list(shape)} weight at "
                               f"{args.num_bits} bits needs {list(needed)}")
