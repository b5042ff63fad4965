"""Where one expert's weights lie in a model's checkpoint, derived from transformers' own mapping.

transformers 5 holds fused experts in memory (`experts.gate_up_proj` [E, 2I, H], ...) but saves,
and finds on the hub, older layouts: one tensor per expert and projection (Mixtral
`block_sparse_moe.experts.{e}.w1.weight`, Qwen `mlp.experts.{e}.gate_proj.weight`), or fused
tensors under other names (GraniteMoE `input_linear.weight`). It keeps the mapping as
WeightConverter/WeightRenaming operations, and `revert_weight_conversion` turns in-memory tensors
into checkpoint tensors. We run it on *probe* tensors (two experts of one layer, real shapes)
whose values are their own element numbers: each value of a reverted tensor names the parameter,
expert and position it holds. From that we read off, per expert parameter, the checkpoint pieces
that make it up (key, strided box, axis order) and how key or box move with the expert index.
Every architecture transformers can convert works without a table of ours; a checkpoint holding
the in-memory names (or Switch Transformers' `expert_{e}` modules) is the identity case.

Limit: an operation that consults the model's parameter shapes (`Transpose(check_dims=True)`,
Qwen3-VL-MoE) sees the two-expert probe and can pick the wrong branch; the store then fails with
a shape error at start-up instead of reading wrong data.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from transformers.core_model_loading import revert_weight_conversion

from offload_runtime.engine.direct_read import phased_empty
from prescient.arch import MoELayer
from prescient.errors import PrescientError

Box = tuple[tuple[int, int, int], ...]  # (start, stop, step) per axis


class StoreError(PrescientError):
    """The expert store cannot map or read an expert: layout, shape, dtype or file trouble."""


@dataclass(frozen=True)
class ExpertSpec:
    """One expert as the model's experts module holds it: parameter name → shape, dtype. `counts`
    gives each fused parameter's leading size in the model (the expert count, or the router's
    choice count where weightless experts have rows too); `flat` names the parameters that hold
    the experts one after another along their first axis ([E * rows, ...], DBRX)."""

    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    counts: dict[str, int] = field(default_factory=dict)
    flat: frozenset[str] = frozenset()

    @property
    def nbytes(self) -> int:
        return sum(math.prod(s) * self.dtypes[n].itemsize for n, s in self.shapes.items())

    def empty(self, n: int, device: torch.device | str = "cpu", pin: bool = False,
              phases: Mapping[str, int] | None = None) -> dict[str, torch.Tensor]:
        """Uninitialised buffers [n, *shape] per parameter; on the CPU, a parameter named in `phases`
        starts at that address phase (`ExpertStore.read_phases`: read around the page cache)."""
        phases = dict(phases or {}) if torch.device(device).type == "cpu" and not pin else {}
        return {
            name: phased_empty((n, *shape), self.dtypes[name], phases[name]) if name in phases
            else torch.empty((n, *shape), dtype=self.dtypes[name], device=device, pin_memory=pin)
            for name, shape in self.shapes.items()
        }

    def as_module_tensor(self, name: str, buffer: torch.Tensor) -> torch.Tensor:
        """Buffer [n, *shape] of `name` shaped as the experts module holds it."""
        return buffer.flatten(0, 1) if name in self.flat else buffer


@dataclass(frozen=True)
class PieceRead:
    """Read `box` of checkpoint tensor `key`, permute its axes by `order`, write it to `dst` of
    parameter `param` (one expert's tensor)."""

    param: str
    key: str
    box: Box
    order: tuple[int, ...]
    dst: Box


@dataclass(frozen=True)
class Piece:
    """A PieceRead for expert 0 and the rule that moves it to expert e: either the key's
    `key_group`-th number grows by `key_stride`, or the box moves along `expert_axis`."""

    read: PieceRead
    probe_shape: tuple[int, ...]  # shape of the checkpoint tensor in the probe (at most 2 experts)
    key_group: int | None = None
    key_stride: int = 0
    expert_axis: int | None = None
    axis_stride: int = 0

    def at(self, expert: int) -> PieceRead:
        read = self.read
        if self.key_group is not None:
            parts = re.split(r"(\d+)", read.key)
            index = 2 * self.key_group + 1
            parts[index] = str(int(parts[index]) + expert * self.key_stride)
            return PieceRead(read.param, "".join(parts), read.box, read.order, read.dst)
        if self.expert_axis is not None:
            box = list(read.box)
            start, stop, step = box[self.expert_axis]
            shift = expert * self.axis_stride
            box[self.expert_axis] = (start + shift, stop + shift, step)
            return PieceRead(read.param, read.key, tuple(box), read.order, read.dst)
        return read

    def file_shape(self, num_experts: int) -> tuple[int, ...]:
        """The checkpoint tensor's shape in a file holding all `num_experts` experts."""
        shape = list(self.probe_shape)
        if self.expert_axis is not None:
            shape[self.expert_axis] += self.axis_stride * (num_experts - 2)
        return tuple(shape)


# what deriving a layer's layout holds at once, per element of one expert: two probe experts' int32
# numbers, their positions, the positions' range, the predicted positions and their comparison
# (118 MiB measured above the store's footprint on runs/tb, 2.85 M elements an expert: 41 bytes each)
LAYOUT_BYTES_PER_ELEMENT = 42


def expert_spec(layer: MoELayer) -> tuple[ExpertSpec, bool]:
    """The spec of one expert of `layer` and whether its experts are fused (tensors holding all
    experts) rather than one submodule per expert (Switch Transformers)."""
    experts, count = layer.experts, layer.num_experts
    if layer.adapter.name != "switch":
        shapes, counts, flat = {}, {}, set()
        for name, param in experts.named_parameters():
            lead = param.shape[0] if param.dim() else 0
            if lead in (count, layer.num_choices):
                shapes[name], counts[name] = tuple(param.shape[1:]), lead
            elif param.dim() >= 2 and lead % count == 0:
                shapes[name], counts[name] = (lead // count, *param.shape[1:]), count
                flat.add(name)
            else:
                raise StoreError(f"layer {layer.index} ({layer.name}): experts parameter {name} "
                                 f"{list(param.shape)} holds neither {count} experts nor {count} row blocks")
        dtypes = {n: p.dtype for n, p in experts.named_parameters()}
        return ExpertSpec(shapes, dtypes, counts, frozenset(flat)), True
    children = list(experts.children())
    if len(children) != count:
        raise StoreError(f"layer {layer.index} ({layer.name}): the experts module holds {len(children)} expert "
                         f"submodules, not {count}")
    params = dict(children[0].named_parameters())
    return ExpertSpec({n: tuple(p.shape) for n, p in params.items()}, {n: p.dtype for n, p in params.items()}), False


class LayoutDeriver:
    """Derives each MoE layer's checkpoint layout. The first layer of each kind is probed with
    real values; a later layer whose reverted keys (probed on the meta device, at no cost) match
    it up to the numbers in the names reuses its layout with the keys renamed."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._known: dict[tuple[str, bool], tuple[list[tuple[str, tuple[int, ...]]], list[Piece]]] = {}

    def pieces(self, layer: MoELayer, spec: ExpertSpec, fused: bool, revert: bool) -> list[Piece]:
        """The pieces of one expert of `layer`; with `revert=False` the checkpoint is assumed to
        hold the model's in-memory names."""
        kind = (f"{type(layer.experts).__name__} {fused} {spec}", revert)
        keys = [(k, tuple(t.shape)) for k, t in self._checkpoint(layer, spec, fused, revert, "meta")[0].items()]
        if kind in self._known:
            renamed = _rename(*self._known[kind], keys)
            if renamed is not None:
                return renamed
        pieces = self._derive(layer, spec, fused, revert)
        self._known.setdefault(kind, (keys, pieces))
        return pieces

    def _checkpoint(self, layer: MoELayer, spec: ExpertSpec, fused: bool, revert: bool, device: str):
        """Probe tensors of (up to) two experts of `layer`, as the checkpoint holds them."""
        n = min(layer.num_experts, 2)
        prefix = next(name for name, m in self.model.named_modules() if m is layer.experts)
        children = [name for name, _ in layer.experts.named_children()]
        probes, firsts = _probe(prefix, spec, fused, n, children, device)
        return (revert_weight_conversion(self.model, probes) if revert else probes), firsts, probes

    def _derive(self, layer: MoELayer, spec: ExpertSpec, fused: bool, revert: bool) -> list[Piece]:
        found, firsts, probes = self._checkpoint(layer, spec, fused, revert, "cpu")
        keys, shapes = list(found), [tuple(t.shape) for t in found.values()]
        where, starts = _inverse(layer, found, sum(t.numel() for t in probes.values()))
        pieces: list[list[PieceRead]] = []
        for e in range(min(layer.num_experts, 2)):
            reads = []
            for name, shape in spec.shapes.items():
                low = firsts[name] + e * math.prod(shape)
                params = where[low:low + math.prod(shape)].reshape(shape)
                for k, box, start, axes in _boxes(params, [(0, size) for size in shape], starts, shapes):
                    reads.append(_as_read(name, keys[k], shapes[k], box, start, axes))
            pieces.append(sorted(reads, key=lambda r: (r.param, r.dst)))
        shape_of = dict(zip(keys, shapes))
        if len(pieces) == 1:
            return [Piece(read, shape_of[read.key]) for read in pieces[0]]
        if len(pieces[0]) != len(pieces[1]):
            raise StoreError(f"layer {layer.index}: experts 0 and 1 lie in different numbers of checkpoint pieces")
        return [_generalise(layer, a, b, shape_of[a.key]) for a, b in zip(*pieces)]


def _rename(known: list[tuple[str, tuple[int, ...]]], pieces: list[Piece],
            found: list[tuple[str, tuple[int, ...]]]) -> list[Piece] | None:
    """`pieces` with each key renamed as `known` → `found` (checkpoint keys and shapes in probe
    order), or None unless every pair has equal shapes and differs by the same numbers in the
    same places (the layer's index)."""
    if len(found) != len(known) or any(a[1] != b[1] for a, b in zip(known, found)):
        return None
    changes = set()
    for (a, _), (b, _) in zip(known, found):
        parts_a, parts_b = re.split(r"(\d+)", a), re.split(r"(\d+)", b)
        if len(parts_a) != len(parts_b) or parts_a[::2] != parts_b[::2]:
            return None
        changes.add(tuple((i, x, y) for i, (x, y) in enumerate(zip(parts_a, parts_b)) if x != y))
    if len(changes) != 1:
        return None
    names = {a: b for (a, _), (b, _) in zip(known, found)}
    return [replace(p, read=replace(p.read, key=names[p.read.key])) for p in pieces]


def _probe(prefix: str, spec: ExpertSpec, fused: bool, n: int, children: list[str], device: str):
    """In-memory tensors of `n` experts whose values number their elements, and the first number
    of each parameter (expert 0)."""
    total = n * sum(math.prod(s) for s in spec.shapes.values())
    dtype = torch.int32 if total < 2**31 else torch.int64
    probes, firsts, first = {}, {}, 0
    for name, shape in spec.shapes.items():
        firsts[name] = first
        codes = torch.arange(first, first + n * math.prod(shape), dtype=dtype, device=device).reshape(n, *shape)
        first += codes.numel()
        if fused:
            probes[f"{prefix}.{name}"] = spec.as_module_tensor(name, codes)
        else:
            probes.update({f"{prefix}.{children[e]}.{name}": codes[e] for e in range(n)})
    return probes, firsts


def _inverse(layer: MoELayer, found: dict[str, torch.Tensor], total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each probe number went: its position in the checkpoint tensors laid end to end, and
    the start of each tensor in that line."""
    # int32 where the positions fit: these [total] tensors are the store's largest allocations while
    # it opens (two experts of runs/tb: int64 took the process 140 MiB above its footprint, and a cap
    # near the smallest that works was killed there rather than refused)
    dtype = torch.int32 if total < 2**31 else torch.int64
    codes = torch.cat([t.reshape(-1) for t in found.values()]).to(dtype)
    where = torch.full((total,), -1, dtype=dtype)
    if codes.numel() == total:
        where[codes] = torch.arange(total, dtype=dtype)
    if codes.numel() != total or (where < 0).any():
        raise StoreError(f"layer {layer.index}: the reverted checkpoint tensors do not hold every expert element "
                         f"exactly once; transformers' conversion for {type(layer.block).__name__} is not a layout")
    sizes = torch.tensor([0] + [t.numel() for t in found.values()])
    return where, sizes.cumsum(0)[:-1]


def _boxes(where: torch.Tensor, box: list[tuple[int, int]], starts: torch.Tensor, shapes: list[tuple[int, ...]]):
    """Split the parameter box `box` (`where`: each element's position, tensors end to end) until
    each part comes from one checkpoint tensor as a strided box with permuted axes. Yields (tensor
    index, box, start coordinates, parameter axis → (checkpoint axis, step)). A part is cut where
    the first element breaks the pattern set by its first element and its neighbours (e.g. gate
    and up rows interleaved in one tensor)."""
    pos = where[tuple(slice(*b) for b in box)]
    first = int(pos.reshape(-1)[0])
    k = int(torch.searchsorted(starts, first, right=True)) - 1
    steps = [int(pos.select(b, 1).reshape(-1)[0]) - first if pos.shape[b] > 1 else 0 for b in range(pos.dim())]
    predicted = first + sum(torch.arange(n, dtype=pos.dtype).reshape([-1 if a == b else 1 for a in range(pos.dim())])
                            * step for b, (n, step) in enumerate(zip(pos.shape, steps)))
    bad = (predicted != pos).reshape(-1).nonzero()
    start = _unravel(first - int(starts[k]), shapes[k])
    axes = None if len(bad) else _axis_map(steps, tuple(pos.shape), start, shapes[k])
    if axes is not None:
        yield k, box, start, axes
        return
    local = _unravel(int(bad[0]) if len(bad) else pos.numel() // 2, tuple(pos.shape))
    axis = next(b for b, u in enumerate(local) if u > 0)
    cut = box[axis][0] + local[axis]
    yield from _boxes(where, [*box[:axis], (box[axis][0], cut), *box[axis + 1:]], starts, shapes)
    yield from _boxes(where, [*box[:axis], (cut, box[axis][1]), *box[axis + 1:]], starts, shapes)


def _axis_map(steps: list[int], sizes: tuple[int, ...], start: list[int], src_shape: tuple[int, ...]):
    """Parameter axis → (checkpoint axis, step) such that flat steps `steps` walk each checkpoint
    axis without leaving it, or None."""
    strides = [math.prod(src_shape[a + 1:]) for a in range(len(src_shape))]
    mapping = {}
    for b, (step, n) in enumerate(zip(steps, sizes)):
        if n == 1:
            continue
        axes = [a for a, s in enumerate(strides)
                if step > 0 and step % s == 0 and start[a] + step // s * (n - 1) < src_shape[a]]
        if not axes:
            return None
        mapping[b] = (axes[0], steps[b] // strides[axes[0]])
    return mapping if len({a for a, _ in mapping.values()}) == len(mapping) else None


def _as_read(name: str, key: str, src_shape: tuple[int, ...], box: list[tuple[int, int]], start: list[int],
             axes: dict[int, tuple[int, int]]) -> PieceRead:
    src = [(c, c + 1, 1) for c in start]
    for b, (a, step) in axes.items():
        src[a] = (start[a], start[a] + step * (box[b][1] - box[b][0] - 1) + 1, step)
    order = tuple(a for _, (a, _) in sorted(axes.items()))
    order += tuple(a for a in range(len(src_shape)) if a not in order)
    return PieceRead(name, key, tuple(src), order, tuple((lo, hi, 1) for lo, hi in box))


def _unravel(index: int, shape: tuple[int, ...]) -> list[int]:
    out = []
    for size in reversed(shape):
        out.append(index % size)
        index //= size
    return out[::-1]


def _generalise(layer: MoELayer, a: PieceRead, b: PieceRead, probe_shape: tuple[int, ...]) -> Piece:
    """The rule taking expert 0's piece `a` to expert 1's piece `b`, hence to any expert."""
    fail = f"layer {layer.index}: experts 0 and 1 of {a.param} are laid out differently ({a.key}, {b.key})"
    if (a.param, a.order, a.dst) != (b.param, b.order, b.dst):
        raise StoreError(fail)
    if a.key != b.key:
        parts_a, parts_b = re.split(r"(\d+)", a.key), re.split(r"(\d+)", b.key)
        differ = [i for i, (x, y) in enumerate(zip(parts_a, parts_b)) if x != y]
        if len(parts_a) != len(parts_b) or len(differ) != 1 or differ[0] % 2 == 0 or a.box != b.box:
            raise StoreError(fail)
        group = differ[0] // 2
        return Piece(a, probe_shape, key_group=group, key_stride=int(parts_b[differ[0]]) - int(parts_a[differ[0]]))
    moved = [i for i, (x, y) in enumerate(zip(a.box, b.box)) if x != y]
    if len(moved) != 1 or a.box[moved[0]][1] - a.box[moved[0]][0] != b.box[moved[0]][1] - b.box[moved[0]][0]:
        raise StoreError(fail)
    axis = moved[0]
    return Piece(a, probe_shape, expert_axis=axis, axis_stride=b.box[axis][0] - a.box[axis][0])
