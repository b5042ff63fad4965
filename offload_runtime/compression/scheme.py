"""The `quantization_config` we write for a compressed checkpoint (`prescient quantize`), in the
format the runtime reads (`prescient.checkpoint_schemes`: a checkpoint's config read and checked).
"""

from __future__ import annotations

from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

from prescient.checkpoint_schemes import FORMAT

BITS = (2, 4, 8, 16)  # what `prescient quantize` writes; 16 is the bf16 copy, not a compressed-tensors scheme


def weight_args(bits: int, group_size: int | None, symmetric: bool = True) -> QuantizationArgs:
    """The weight arguments of a group-wise (or, without a group size, per output channel) integer scheme."""
    strategy = "group" if group_size else "channel"
    return QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy,
                            group_size=group_size or None)


def config_dict(targets: list[str], args: QuantizationArgs) -> dict:
    """The `quantization_config` entry of config.json for experts matching `targets`, as
    compressed-tensors' own `ModelCompressor.update_config` writes it."""
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=targets, weights=args)},
                                format=FORMAT, quantization_status="compressed")
    return {"quant_method": "compressed-tensors", **config.model_dump(exclude=["quant_method"])}
