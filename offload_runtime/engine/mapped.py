"""The model with every weight a zero-copy view of its memory-mapped safetensors file: the
kernel's page cache is the expert cache, as in llama.cpp's mmap runs. `--memory` loads the model
so where every expert fits (and where `tune` measured it fastest): nothing is copied at load, and a
cap a little under the model's need costs re-reads of the pages the kernel drops, not a kill. Nothing is copied at load;
a weight's pages are read from the file when a forward first touches them, and under memory
pressure the kernel drops clean pages and reads them again when next used.

The safetensors layout is read here (8-byte little-endian header length, a JSON header of
`name -> {dtype, shape, data_offsets}`, then the data), since `safetensors`' own readers copy
each tensor out of their mapping. The mapping is private (copy-on-write), so torch gets a
writable buffer; nothing writes to it, so every page stays a clean, shared page of the file.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import torch
from torch import nn

from offload_runtime.engine import rowdot
from offload_runtime.engine.expert_layout import LayoutDeriver, expert_spec
from prescient.arch import MoELayer, find_moe_layers
from prescient.errors import ModelFilesError
from prescient.model_dir import ModelDirectory

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


def map_safetensors(path: Path) -> tuple[mmap.mmap, dict[str, torch.Tensor]]:
    """The file mapped copy-on-write, and each tensor in it as a view of the mapping."""
    with open(path, "rb") as handle:
        mapping = mmap.mmap(handle.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    (header_len,) = struct.unpack("<Q", mapping[:8])
    header = json.loads(mapping[8 : 8 + header_len])
    base = 8 + header_len
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in DTYPES:
            raise ModelFilesError(f"{path}: tensor {name} has dtype {entry['dtype']}, which the mmap loader "
                                  "cannot view")
        dtype, (start, end) = DTYPES[entry["dtype"]], entry["data_offsets"]
        count = (end - start) // dtype.itemsize
        flat = torch.frombuffer(mapping, dtype=dtype, count=count, offset=base + start) if count else \
            torch.empty(0, dtype=dtype)
        tensors[name] = flat.view(entry["shape"])
    return mapping, tensors


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    if leaf in module._parameters:
        module._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[leaf] = value


def _box(view: torch.Tensor, box) -> torch.Tensor:
    return view[tuple(slice(start, stop, step) for start, stop, step in box)]


class MappedExperts(nn.Module):
    """A fused experts module (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]) computing from
    views of the mapped checkpoint: `pieces[e][param]` lists (rows of the expert's weight, view),
    since a checkpoint may store one expert's fused weight as separate tensors (Mixtral's w1 and
    w3 for `gate_up_proj`); each piece is a `linear` into its rows of the output. A token's k
    expert outputs are weighted, then summed in router order, as transformers' grouped_mm and
    batched_mm kernels (the plain model's default) sum them."""

    def __init__(self, original: nn.Module, pieces: list[dict[str, list[tuple[slice, torch.Tensor]]]]) -> None:
        super().__init__()
        self.apply_gate, self.pieces = original._apply_gate, pieces  # the model's own gating (act(gate) * up)
        self.matvec = False  # `use_matvec`: a decode row against a wide matrix through `rowdot.product`

    def use_matvec(self) -> None:
        """Compute a decode token's rows as "gemv" does (`expert_kernels.gemv_experts_forward`): per
        parameter stored whole, `rowdot.product` where `rowdot.streams` holds for its view."""
        self.matvec = True

    def _linear(self, x: torch.Tensor, expert: int, param: str) -> torch.Tensor:
        parts = self.pieces[expert][param]
        if len(parts) == 1:
            if self.matvec and len(x) == 1 and rowdot.streams(parts[0][1]):
                return rowdot.product(x, parts[0][1])
            return nn.functional.linear(x, parts[0][1])
        out = x.new_empty(x.shape[0], max(rows.stop for rows, _ in parts))
        for rows, weight in parts:
            out[:, rows] = nn.functional.linear(x, weight)
        return out

    def _expert(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        return self._linear(self.apply_gate(self._linear(x, expert, "gate_up_proj")), expert, "down_proj")

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:
        tokens, k = top_k_index.shape
        if tokens == 1:  # decode: one row per expert, the ids read once
            out = torch.cat([self._expert(hidden_states, e) for e in top_k_index[0].tolist()])
            return (out * top_k_weights.reshape(-1, 1)).view(1, k, -1).sum(dim=1).to(hidden_states.dtype)
        out = hidden_states.new_empty(tokens, k, hidden_states.shape[-1])
        for expert in top_k_index.unique().tolist():
            token_idx, pos = torch.where(top_k_index == expert)
            out[token_idx, pos] = self._expert(hidden_states[token_idx], expert) * top_k_weights[token_idx, pos, None]
        return out.sum(dim=1).to(hidden_states.dtype)


def _expert_pieces(model: nn.Module, layer, directory: ModelDirectory, views: dict[str, torch.Tensor]):
    """Per expert of `layer`, per parameter: (output rows, view of the mapped file), from the
    checkpoint layout the offload runtime's store reads (`expert_layout`)."""
    experts = layer.experts
    flags = [getattr(experts, f, d) for f, d in (("has_gate", True), ("is_transposed", False), ("has_bias", False),
                                                 ("has_post_expert_norm", False))]
    spec, fused = expert_spec(layer)
    if not fused or flags != [True, False, False, False] or set(spec.shapes) != {"gate_up_proj", "down_proj"}:
        raise ModelFilesError(f"{directory}: the mmap loader computes gated experts stored as gate_up_proj and "
                              f"down_proj; layer {layer.index}'s {type(experts).__name__} is not one")
    deriver = LayoutDeriver(model)
    for revert in (True, False):
        pieces = deriver.pieces(layer, spec, fused, revert)
        if all(piece.at(0).key in views for piece in pieces):
            break
    else:
        raise ModelFilesError(f"{directory}: layer {layer.index}'s experts are in none of its safetensors files")
    out = []
    for expert in range(layer.num_experts):
        params: dict[str, list[tuple[slice, torch.Tensor]]] = {name: [] for name in spec.shapes}
        for piece in pieces:
            read = piece.at(expert)
            view = _box(views[read.key], read.box).permute(read.order)
            (row0, row1, step), *rest = read.dst
            if step != 1 or [tuple(r) for r in rest] != [(0, n, 1) for n in spec.shapes[read.param][1:]]:
                raise ModelFilesError(f"{directory}: {read.key} fills a block of {read.param} that is not whole rows")
            params[read.param].append((slice(row0, row1), view))
        out.append(params)
    return out


def _map_files(directory: ModelDirectory) -> tuple[list[mmap.mmap], dict[str, torch.Tensor]]:
    mappings, views = [], {}
    for file in directory.weight_files:
        mapping, tensors = map_safetensors(file)
        mappings.append(mapping)
        views.update(tensors)
    return mappings, views


def load_mmap_model(model_dir: str | Path | ModelDirectory, dtype: torch.dtype | None = None
                    ) -> tuple[nn.Module, list[MoELayer]]:
    """The model built without weights (in `dtype`, default the checkpoint's), each checkpoint
    tensor set to its view of the mapped file (tied weights tied after) and each MoE layer's experts
    a `MappedExperts` over the views, and its MoE layers as found before (their `experts` the
    weightless originals); the mappings live as long as the model (`model.mmaps`). ModelFilesError where a weight is missing,
    is stored in another dtype or shape than the model's, or the experts are of another kind."""
    from transformers import GenerationConfig
    from transformers.core_model_loading import revert_weight_conversion

    directory = ModelDirectory.of(model_dir)
    model = directory.weightless_model(dtype)
    layers = find_moe_layers(model)
    model.mmaps, views = _map_files(directory)
    expert_ids = {id(p) for layer in layers for p in layer.experts.parameters()}
    wanted = {name: t for name, t in model.state_dict(keep_vars=True).items() if id(t) not in expert_ids}
    checkpoint_name = {id(t): name for name, t in revert_weight_conversion(model, dict(wanted)).items()}
    for name, tensor in wanted.items():
        key = directory.checkpoint_key(checkpoint_name.get(id(tensor), name))
        if key is None:
            continue  # tied, or a buffer the model computes: checked below
        view = views[key]
        if view.dtype != tensor.dtype or view.shape != tensor.shape:
            raise ModelFilesError(f"{directory}: {key} is stored as {view.dtype} {list(view.shape)}, the model wants "
                                  f"{tensor.dtype} {list(tensor.shape)}; the mmap loader does not convert")
        _set_tensor(model, name, view)
    for layer in layers:
        layer.block.experts = MappedExperts(layer.experts, _expert_pieces(model, layer, directory, views))
    model.tie_weights()
    missing = [name for name, param in model.named_parameters() if param.is_meta]
    if missing:
        raise ModelFilesError(f"{directory}: no weight for {missing[:3]} in its safetensors files")
    if (directory.path / "generation_config.json").exists():
        model.generation_config = GenerationConfig.from_pretrained(directory.path)
    return model.eval(), layers


def mapped_share(model: nn.Module) -> float:
    """The share of the bytes of the model's weights (parameters and expert views) that lie inside
    its file mappings: 1.0 when loading copied nothing."""
    import ctypes

    ranges = []
    for mapping in model.mmaps:
        start = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
        ranges.append((start, start + len(mapping)))
    tensors = list(model.parameters()) + [view for module in model.modules() if isinstance(module, MappedExperts)
                                          for params in module.pieces for parts in params.values()
                                          for _, view in parts]
    seen, inside, total = set(), 0, 0
    for tensor in tensors:
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        total += tensor.nbytes
        inside += tensor.nbytes if any(a <= tensor.data_ptr() < b for a, b in ranges) else 0
    return inside / total if total else 1.0
