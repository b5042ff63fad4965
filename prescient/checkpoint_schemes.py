"""What a compressed checkpoint's `quantization_config` says, checked: read where a model
directory is opened (`ModelDirectory.compression`), used by the runtime's compressed experts.

A compressed-tensors config holds `config_groups`, each a scheme (weight arguments: bits, type,
symmetric, strategy, group size) with `targets` (module class names, or `re:` regexes over module
names) and one `ignore` list. A checkpoint tensor `<module>.weight_packed` is compressed; its
module's scheme is the first group whose targets name it (a regex that matches, else a class
name, since every compressed module of a checkpoint is a linear layer) and that `ignore` leaves.
The runtime expands weight-only integer schemes of the `pack-quantized` format, group-wise or
per channel; any other scheme is refused by name before a weight is read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
from pydantic import ValidationError

from prescient.errors import PrescientError

FORMAT = "pack-quantized"
PACKED_SUFFIX = "weight_packed"  # a compressed module's packed weight: `<module>.weight_packed`


class CompressionError(PrescientError, ValueError):
    """A compressed checkpoint or a quantisation request the project cannot read or write."""


@dataclass(frozen=True)
class WeightScheme:
    """How one compressed weight is stored: its compressed-tensors scheme and the group that holds it."""

    group: str
    scheme: QuantizationScheme

    @property
    def args(self) -> QuantizationArgs:
        return self.scheme.weights


class CheckpointSchemes:
    """The schemes of a checkpoint's compressed weights, read from its config.json's
    `quantization_config`; `None` from `of` when the checkpoint is not compressed."""

    def __init__(self, config: QuantizationConfig) -> None:
        self.config = config

    @classmethod
    def of(cls, model_config: dict, where: str) -> CheckpointSchemes | None:
        raw = model_config.get("quantization_config")
        if raw is None:
            return None
        if not isinstance(raw, dict) or raw.get("quant_method") != "compressed-tensors":
            method = raw.get("quant_method") if isinstance(raw, dict) else raw
            raise CompressionError(f"{where}: quantization method {method!r} is not one the runtime reads; it reads "
                                   "compressed-tensors checkpoints (quant_method 'compressed-tensors')")
        try:
            config = QuantizationConfig.model_validate({k: v for k, v in raw.items() if k != "quant_method"})
        except ValidationError as exc:
            first = exc.errors()[0]
            raise CompressionError(f"{where}: quantization_config is malformed at "
                                   f"{'.'.join(map(str, first['loc']))} ({first['msg']})") from None
        return cls(config)

    def for_module(self, module: str, where: str) -> WeightScheme:
        """The scheme of the compressed weight of `module` (its name in the checkpoint), checked
        to be one the runtime expands; a CompressionError naming the scheme otherwise."""
        if _matches(self.config.ignore or [], module, by_class=False):
            raise CompressionError(f"{where}: {module} is stored compressed but quantization_config ignores it")
        named = [(name, group) for name, group in self.config.config_groups.items()
                 if _matches(group.targets, module, by_class=False)]
        by_class = [(name, group) for name, group in self.config.config_groups.items()
                    if _matches(group.targets, module, by_class=True)]
        if not (named or by_class):
            raise CompressionError(f"{where}: {module} is stored compressed but no quantization_config group "
                                   "targets it")
        name, scheme = (named or by_class)[0]
        _check_runnable(scheme, self.config.format, f"{where}: {module} (quantization group {name})")
        return WeightScheme(name, scheme)


def _matches(targets: list[str], module: str, by_class: bool) -> bool:
    for target in targets:
        if target.startswith("re:"):
            if not by_class and re.match(target[3:], module):
                return True
        elif by_class:
            return True
        elif target == module:
            return True
    return False


def _check_runnable(scheme: QuantizationScheme, config_format: str | None, what: str) -> None:
    fmt = scheme.format or config_format
    weights, acts = scheme.weights, scheme.input_activations
    problems = []
    if fmt != FORMAT:
        problems.append(f"format {fmt!r} (the runtime reads {FORMAT!r})")
    if weights is None:
        problems.append("no weight quantisation")
    else:
        if weights.type != "int":
            problems.append(f"weight type {weights.type!r} (the runtime reads 'int')")
        if weights.strategy not in ("group", "channel"):
            problems.append(f"strategy {weights.strategy!r} (the runtime reads 'group' and 'channel')")
        if weights.actorder == "group":
            problems.append("activation order 'group' (its g_idx is not read by the runtime)")
    if acts is not None or scheme.output_activations is not None:
        problems.append("quantised activations (the runtime runs weight-only schemes)")
    if problems:
        raise CompressionError(f"{what} has a scheme the runtime cannot run: {'; '.join(problems)}")
