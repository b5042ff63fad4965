"""GPTQ for routed experts (Frantar et al., 2023): each expert weight's levels are chosen column
by column, and the error a rounded column makes is carried into the columns still to round,
weighted by the expert's own calibration inputs (H = XᵀX over the tokens routed to it).

Scales stay round-to-nearest's (each group's min/max of the source weight: "static groups"), so
a GPTQ checkpoint has RTN's layout, scales and bytes; only the levels differ, and the writer packs
them through the same codec. Layers are done in order and each is quantised in the model before
the next one's inputs are collected, so a layer is calibrated on what its quantised predecessors
compute ("true sequential").

An expert's inputs are caught where it computes: every `F.linear` whose weight is one expert's
slice of the experts module's parameters (transformers' fused experts index a 3-D parameter per
expert; per-expert modules hold 2-D ones). An architecture whose experts compute otherwise (a
batched matmul over all experts) is refused. An expert no calibration token reached keeps RTN's
levels. Inputs are summed over the columns that hold a weight only, so zero padding costs neither
memory nor time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.utils import calculate_range
from torch.overrides import TorchFunctionMode
from tqdm import tqdm
from transformers import PreTrainedModel
from transformers.core_model_loading import revert_weight_conversion

from offload_runtime.compression.codec import SCALE_DTYPE, group_scales
from prescient.arch import MoELayer
from prescient.checkpoint_schemes import CompressionError

DAMP = 0.1  # the Hessian's diagonal is raised by DAMP × its mean (GPTQ's reference code: 0.01); on the base
#             reference model a prototype gave KL within 5% at 0.01, 0.03 and 0.1, perplexity within its noise
BLOCK = 128  # columns rounded before their error is carried to the rest at once (the paper's lazy batch)
MAX_HESSIAN_BYTES = 4 * 2**30  # one layer's Hessians held at once


def gptq_weight(weight: torch.Tensor, hessian: torch.Tensor, args: QuantizationArgs, damp: float = DAMP,
                columns: torch.Tensor | None = None) -> torch.Tensor:
    """`weight` [out, in] with its levels chosen by GPTQ under `hessian` [n, n] of the input
    `columns` (default: all `in` of them; the others round to nearest), on the grid
    round-to-nearest gives `weight`: float32 values of a level times its group's scale, rounded to
    the scale's dtype as the codec expands them (the weights the model will compute with)."""
    w = weight.detach().float().clone()
    scale = group_scales(w, args)[0].float()  # [out, groups]
    group = w.shape[1] // scale.shape[1]
    low, high = (float(v) for v in calculate_range(args, "cpu"))

    def rounded(values: torch.Tensor, where: torch.Tensor) -> torch.Tensor:  # [out, n] at input columns `where`
        s = scale[:, where // group]
        return ((values / s).round().clamp(low, high) * s).to(SCALE_DTYPE)

    chosen = rounded(w, torch.arange(w.shape[1])).float()
    # an input that was always zero (one no token reached) has no error to weigh: it rounds to
    # nearest, and GPTQ runs on the others (its Hessian row is zero)
    seen = hessian.diagonal() > 0
    live = (torch.arange(w.shape[1]) if columns is None else columns)[seen]
    if len(live) == 0:
        return chosen
    w = w[:, live]
    h = hessian.detach()[seen][:, seen].double()
    h.diagonal().add_(damp * h.diagonal().mean())
    inverse = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()
    for start in range(0, len(live), BLOCK):
        stop = min(start + BLOCK, len(live))
        block, errors = w[:, start:stop], torch.empty(w.shape[0], stop - start)
        for i, column in enumerate(range(start, stop)):
            chosen[:, live[column]] = rounded(block[:, i:i + 1], live[column:column + 1])[:, 0].float()
            errors[:, i] = (block[:, i] - chosen[:, live[column]]) / inverse[column, column]
            block[:, i:] -= errors[:, i, None] * inverse[column, column:stop]
        w[:, stop:] -= errors @ inverse[start:stop, stop:]
    return chosen


def _weighted_columns(weight: torch.Tensor) -> torch.Tensor:
    """The input columns of `weight` [out, in] that hold a non-zero weight. A column of zeros
    rounds to zeros whatever its inputs, and GPTQ carries no error into it from its neighbours
    here (a zero-padded expert, as the bench model's widening, then costs its padding nothing)."""
    return weight.detach().ne(0).any(0).nonzero().flatten()


class _ExpertInputs(TorchFunctionMode):
    """While active, sums xᵀx over the weighted input columns (`_weighted_columns`) for every
    `F.linear` whose weight is one expert's slice of `params` (name → parameter, [E, out, in] or
    [out, in]); keyed by (name, expert or None), with `columns` the columns of each."""

    def __init__(self, params: dict[str, torch.nn.Parameter], columns: dict[tuple[str, int | None], torch.Tensor]):
        super().__init__()
        self.params, self.columns = params, columns
        self.hessians: dict[tuple[str, int | None], torch.Tensor] = {}

    def _expert(self, weight: torch.Tensor) -> tuple[str, int | None] | None:
        address = weight.data_ptr()
        for name, param in self.params.items():
            start = param.data_ptr()
            if start <= address < start + param.numel() * param.element_size() \
                    and tuple(weight.shape) == tuple(param.shape[-2:]):
                return name, (address - start) // (param.stride(0) * param.element_size()) if param.dim() == 3 else None
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            weight = args[1] if len(args) > 1 else kwargs["weight"]
            key = self._expert(weight)
            if key is not None:
                x = args[0].detach().reshape(-1, args[0].shape[-1])[:, self.columns[key]].float()
                if key not in self.hessians:
                    self.hessians[key] = torch.zeros(x.shape[1], x.shape[1])
                self.hessians[key].addmm_(x.T, x)
        return func(*args, **kwargs)


@torch.no_grad()
def gptq_experts(model: PreTrainedModel, layers: list[MoELayer], args: QuantizationArgs, windows: torch.Tensor,
                 batch_size: int = 8, damp: float = DAMP) -> dict[str, torch.Tensor]:
    """Quantise every MoE layer's expert weights in `model` (float32) by GPTQ, calibrated on the
    token `windows` [N, S]; returns the chosen weights under their checkpoint names (as
    `save_pretrained` writes them), each on round-to-nearest's grid of the source tensor."""
    chosen: dict[str, torch.Tensor] = {}
    prefix = {id(m): name for name, m in model.named_modules()}
    for layer in tqdm(layers, desc="GPTQ", unit="layer", disable=None):
        params = {name: p for name, p in layer.experts.named_parameters() if p.dim() >= 2 and "bias" not in name}
        columns = {(name, expert): _weighted_columns(p if expert is None else p[expert])
                   for name, p in params.items() for expert in (range(len(p)) if p.dim() == 3 else [None])}
        need = sum(len(c) ** 2 * 4 for c in columns.values())
        if need > MAX_HESSIAN_BYTES:
            raise CompressionError(f"--method gptq: layer {layer.index}'s expert Hessians need {need / 2**30:.1f} GiB "
                                   f"(more than {MAX_HESSIAN_BYTES / 2**30:.0f}); use --method rtn")
        with _ExpertInputs(params, columns) as inputs:
            for batch in windows.split(batch_size):
                model(batch)
        missing = sorted(set(params) - {name for name, _ in inputs.hessians})
        if missing:
            raise CompressionError(f"--method gptq: the experts of {type(layer.experts).__name__} do not compute "
                                   f"{', '.join(missing)} one expert at a time through F.linear; use --method rtn")
        for (name, expert), hessian in inputs.hessians.items():
            weight = params[name] if expert is None else params[name][expert]
            weight.copy_(gptq_weight(weight, hessian, args, damp, columns[name, expert]))  # later layers see it quantised
        module = prefix[id(layer.experts)]
        chosen.update(revert_weight_conversion(model, {f"{module}.{name}": p.detach().clone()
                                                       for name, p in params.items()}))
    return chosen
