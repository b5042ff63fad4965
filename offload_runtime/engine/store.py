"""ExpertStore: the slow tier. Reads one expert's weights from the model directory's own
safetensors files and returns them shaped like one expert of the model's experts module.

Only that expert's bytes are read: the checkpoint layout (`expert_layout`) says which tensors and
which boxes of them make up an expert; the safetensors header (8-byte length, JSON, raw row-major
little-endian data) says where they lie, and `os.preadv` reads them, straight into the
destination when the box is contiguous (a slot, a pinned buffer). We read with pread instead of
`safe_open`'s memory map so that nothing keeps the file's pages mapped: dropping them works.

Compressed experts (a compressed-tensors `pack-quantized` checkpoint, `prescient quantize`'s or
a user's): a piece whose checkpoint weight is stored as `<module>.weight_packed` (+ scale, shape,
zero point) is read as those parts, the bytes that cross the link (`stored_nbytes`), and on
arrival either expanded into the slot in the model's dtype (`offload_runtime.compression.codec`),
or, with `slot_format="packed"` (symmetric int4 in groups, int8 per channel), re-arranged into
the operands of torch's weight-only kernels so that the slot stays compressed
(`offload_runtime.compression.kernels`; `slot_specs` and `packed` say what a slot then holds).
Scales and shapes are checked once when the store opens. Experts stored in another float dtype
than the model's (a bf16 copy served in float32) are converted as they are read.

Modes:
- `disk`: every `read` reads the file. With `drop_page_cache=True` the store turns the files'
  read-ahead off (`POSIX_FADV_RANDOM`), drops each file's whole page cache at its first read
  (what loading the other weights left there) and then the pages of each read after it
  (`POSIX_FADV_DONTNEED`), so the kernel's page cache does not quietly hold the experts and a
  memory budget means something. (Dropping the whole file after every read cost 0.5 ms an
  expert.)
  Checked on this machine (ext4) with util-linux `fincore`: the file's cached pages drop to
  zero after a read, and reading all experts of a 530 MB model again ran at 0.28 GB/s against
  3.7 GB/s from the page cache. Not dropped: pages another mapping holds (a model loaded with
  `from_pretrained` keeps its safetensors files memory-mapped: load the offloaded model with its
  experts on the meta device or release them), dirty pages of a file just written, and
  read-ahead still in flight. Where the file system takes `O_DIRECT`, a read passes around the page
  cache instead (`direct_read`): straight into a slot that lies at the file's phase (`read_phases`,
  which the slot pool allocates by), else through the reading thread's bounce buffer; none of its
  pages enter the cache (a 34 MB expert: 2.2 ms of CPU in place, 3.9 bounced, 15.0 buffered).
- `host`: every expert is read once into host memory (one [E, ...] buffer per layer and
  parameter, pinned with `pin_memory` when CUDA is available); `read` copies from there and
  `resident` returns the host tensors themselves for asynchronous copies.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import math
import mmap
import os
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn
from tqdm import tqdm

from cache.policy import Key
from offload_runtime.compression.codec import check_parts, compressed_names, expand_into
from offload_runtime.compression.kernels import (KERNEL_DTYPE, SCALES_SUFFIX, PackedMatrixSpec, kernel_matrix,
                                                 pack_for_kernel)
from offload_runtime.engine.direct_read import (ALIGN, bounce_size, can_read_direct, open_direct, phase_of, read_bounced,
                                                 read_edges)
from offload_runtime.engine.expert_layout import ExpertSpec, LayoutDeriver, Piece, PieceRead, StoreError, expert_spec
from prescient.arch import MoELayer, find_moe_layers
from prescient.checkpoint_schemes import PACKED_SUFFIX, CompressionError, WeightScheme
from prescient.model_dir import ModelDirectory, checkpoint_names

log = logging.getLogger(__name__)

__all__ = ["ExpertStore", "ExpertSpec", "Key", "StoreError"]

MIN_CHUNK = 256 << 10  # a read splits into parallel reads of at least this many bytes,
CHUNK_ALIGN = max(mmap.PAGESIZE, ALIGN)  # each starting a page (and a direct read's block) after the one before

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class _Entry:
    """One tensor of a safetensors file: where its data starts (absolute byte offset)."""

    path: Path
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class _Step:
    """One piece of one expert, resolved to a file position: read `span` elements at `offset`,
    view them with `size`/`stride`, permute by `order`, copy to `dst` of `param`."""

    param: str
    path: Path
    offset: int
    span: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    order: tuple[int, ...]
    dst: tuple[slice, ...]
    plain: bool  # the piece is contiguous in the file and in the expert's tensor: read in place
    compressed: _Compressed | None = None  # the piece's tensor is stored compressed: offset counts in its expansion


@dataclass(frozen=True)
class _Compressed:
    """A weight stored compressed (`<module>.weight_packed`, `.weight_scale`, ...): the file
    entries of its parts, its scheme, and its shape [out, in] once expanded."""

    module: str
    parts: dict[str, _Entry]
    scheme: WeightScheme
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return sum(math.prod(e.shape) * e.dtype.itemsize for e in self.parts.values())


def _read_header(path: Path) -> dict[str, _Entry]:
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            if not 2 <= length <= size - 8:
                raise ValueError(f"header length {length} does not fit a {size}-byte file")
            header = json.loads(handle.read(length))
        entries = {}
        for key, info in header.items():
            if key == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            shape, dtype = tuple(info["shape"]), _DTYPES[info["dtype"]]
            if end - begin != math.prod(shape) * dtype.itemsize or 8 + length + end > size:
                raise ValueError(f"tensor {key} has inconsistent offsets {begin}..{end}")
            entries[key] = _Entry(path, 8 + length + begin, shape, dtype)
        return entries
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise StoreError(f"weight file {path} is corrupt or unreadable ({exc!r})") from exc


def _index(model_dir: ModelDirectory) -> dict[str, _Entry]:
    """Every tensor of the directory's weight files, where its data lies."""
    entries: dict[str, _Entry] = {}
    for path in model_dir.weight_files:
        entries.update(_read_header(path))
    return entries


def _plan(read: PieceRead, entry: _Entry, compressed: _Compressed | None = None) -> _Step:
    """The step reading `read` from `entry` (for a compressed weight: from its expansion, an
    entry at offset 0 of the weight's shape and dtype)."""
    strides = [math.prod(entry.shape[a + 1:]) for a in range(len(entry.shape))]
    size = tuple(len(range(*b)) for b in read.box)
    first = sum(b[0] * s for b, s in zip(read.box, strides))
    last = sum((b[0] + (n - 1) * b[2]) * s for b, n, s in zip(read.box, size, strides))
    stride = tuple(s * b[2] for b, s in zip(read.box, strides))
    kept = [a for a in read.order if size[a] > 1]
    contiguous = all(stride[a] == math.prod(size[b] for b in kept[i + 1:]) for i, a in enumerate(kept))
    return _Step(read.param, entry.path, entry.offset + first * entry.dtype.itemsize, last - first + 1,
                 entry.dtype, size, stride, read.order, tuple(slice(*d) for d in read.dst),
                 plain=contiguous and all(d[2] == 1 for d in read.dst), compressed=compressed)


class ExpertStore:
    """Reads experts `(layer, expert)` of `model` (its MoE layers in forward order) from the
    safetensors files in `model_dir` (a path, or the directory already opened). `model` may hold its experts on the meta device: only
    their shapes and dtypes are used."""

    def __init__(
        self,
        model_dir: str | Path | ModelDirectory,
        model: nn.Module,
        layers: Sequence[MoELayer] | None = None,
        mode: Literal["disk", "host"] = "disk",
        drop_page_cache: bool = False,
        pin: bool | None = None,
        slot_format: Literal["expanded", "packed"] = "expanded",
        read_depth: int = 1,
    ) -> None:
        if mode not in ("disk", "host"):
            raise StoreError(f"unknown store mode {mode!r}; use 'disk' or 'host'")
        if slot_format not in ("expanded", "packed"):
            raise StoreError(f"unknown slot format {slot_format!r}; use 'expanded' or 'packed'")
        directory = ModelDirectory.of(model_dir)
        self.model_dir = directory.path
        # the layers are read here and not kept: the transfer threads hold the store, and must not
        # keep the model alive (a runtime dropped unclosed is then collected and stops them)
        layers = list(layers) if layers is not None else find_moe_layers(model)
        self.num_layers = len(layers)
        self.mode = mode
        self.drop_page_cache = drop_page_cache
        self.num_experts = layers[0].num_experts
        if any(layer.num_experts != self.num_experts for layer in layers):
            raise StoreError(f"the MoE layers differ in expert count: {[x.num_experts for x in layers]}")
        self._index = _index(directory)
        self._schemes = directory.compression
        self.specs: list[ExpertSpec] = []
        self._plans: list[list[list[_Step]]] = []  # [layer][expert] → steps
        layouts = LayoutDeriver(model)
        for layer in layers:
            spec, fused = expert_spec(layer)
            self.specs.append(spec)
            self._plans.append(self._plan_layer(layouts, layer, spec, fused))
        self._stored = [[_stored_nbytes(steps) for steps in layer_plans] for layer_plans in self._plans]
        # what a slot holds: the expert as the module holds it, or its weights packed for the kernels
        self.packed: dict[str, PackedMatrixSpec] = self._packed_matrices() if slot_format == "packed" else {}
        self.slot_specs = [_packed_spec(spec, self.packed) for spec in self.specs] if self.packed else self.specs
        paths = {path for layer_plans in self._plans for steps in layer_plans for step in steps
                 for path in _files(step)}
        self._fds = {path: os.open(path, os.O_RDONLY) for path in paths}
        self._dropped: set[int] = set()  # files whose whole page cache was dropped once
        self._direct = self._open_direct(paths) if drop_page_cache and mode == "disk" else {}
        self._direct_refused: set[Path] = set()  # opened with O_DIRECT, but a direct read was refused
        self._bounces = threading.local()  # per reading thread, where a slot is not at its piece's phase
        self.bounce_bytes = bounce_size(self.expert_nbytes)
        # one read split into `read_depth` reads in flight at once: the queue depth a storage device
        # needs for its rate, reached by a single expert's read, with no buffer beyond the slot
        self._readers = ThreadPoolExecutor(read_depth, "expert-read") if read_depth > 1 else None
        self.read_depth = read_depth
        if drop_page_cache and mode == "disk":  # no read-ahead: only the bytes read enter the cache
            for fd in self._fds.values():
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        self._host: list[dict[str, torch.Tensor]] | None = None
        if mode == "host":
            self._load_host(torch.cuda.is_available() if pin is None else pin)
            self.close()  # host mode never reads the files again

    # -- public ------------------------------------------------------------------------------

    @property
    def spec(self) -> ExpertSpec:
        """The one slot spec of every layer; a StoreError if layers differ."""
        specs = self.slot_specs
        if any(s != specs[0] for s in specs):
            raise StoreError(f"the MoE layers' experts differ in shape or dtype: {sorted(set(map(str, specs)))}")
        return specs[0]

    @property
    def expert_nbytes(self) -> int:
        """The bytes one slot holds."""
        return self.spec.nbytes

    @property
    def total_nbytes(self) -> int:
        """The bytes all experts take in slots."""
        return sum(spec.nbytes for spec in self.slot_specs) * self.num_experts

    def stored_nbytes(self, key: Key) -> int:
        """The bytes one read of expert `key` takes from the files: what crosses the link
        (compressed bytes for a compressed checkpoint, where `expert_nbytes` is a slot's); in
        host mode, the slot's bytes that each read copies."""
        layer, expert = self._check(key)
        return self.slot_specs[layer].nbytes if self._host is not None else self._stored[layer][expert]

    @property
    def compressed(self) -> bool:
        """Whether the experts are stored compressed (a compressed-tensors checkpoint)."""
        return any(step.compressed is not None for step in self._plans[0][0])

    def read(self, key: Key, out: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Expert `key`'s tensors, one per parameter name of the experts module, each shaped like
        that parameter's [e] slice (packed slots: the tensors of `slot_specs`). With `out` (e.g. a
        slot's views) they are written there."""
        layer, expert = self._check(key)
        spec = self.slot_specs[layer]
        if out is None:
            out = {name: torch.empty(shape, dtype=spec.dtypes[name]) for name, shape in spec.shapes.items()}
        out = dict(out)
        if self._host is not None:
            for name, tensor in out.items():
                tensor.copy_(self._host[layer][name][expert])
            return out
        self._fill(layer, expert, out)
        return out

    def resident(self, key: Key) -> dict[str, torch.Tensor] | None:
        """Host mode: the expert's host (pinned when CUDA is available) tensors, not copies; do
        not modify them. Disk mode: None."""
        if self._host is None:
            return None
        layer, expert = self._check(key)
        return {name: buffer[expert] for name, buffer in self._host[layer].items()}

    def host_layer(self, layer: int) -> dict[str, torch.Tensor] | None:
        """Host mode: layer `layer`'s experts as [E, ...] host tensors, laid out as the slot pool's
        [S, ...] buffers (not copies; do not modify), so an experts module can compute on them where
        they live. Disk mode: None."""
        return None if self._host is None else self._host[layer]

    @property
    def reads_direct(self) -> bool:
        """Whether every read passes around the page cache (`direct_read`): the plan then books no page
        cache for reads (`MemoryPlanner.slots(direct_buffers=...)`)."""
        return bool(self._direct) and self._direct.keys() == self._fds.keys()

    @functools.cached_property
    def reads_in_place(self) -> bool:
        """Whether every read goes straight into slots laid out at `read_phases` (every piece lies
        at its parameter's phase): no bounce buffer, no copy."""
        slot_params = {name for spec in self.slot_specs for name in spec.shapes}
        return (self.reads_direct and self.read_phases.keys() == slot_params
                and all(phase == self.read_phases[param] for param, phase, _ in self._piece_phases()))

    @functools.cached_property
    def read_phases(self) -> dict[str, int]:
        """Per slot parameter, the address phase (`direct_read.phase_of`) its slot buffers take: the
        one most of its bytes in the checkpoint need to be read in place (a checkpoint whose layers lie
        at different phases reads the others through bounce buffers). Empty where every read goes
        through the page cache."""
        if not self._direct:
            return {}
        weights: dict[str, Counter] = {}
        for param, phase, nbytes in self._piece_phases():
            if phase is not None:
                weights.setdefault(param, Counter())[phase] += nbytes
        return {param: counts.most_common(1)[0][0] for param, counts in weights.items()}

    def _piece_phases(self) -> Iterator[tuple[str, int | None, int]]:
        """Per piece of every expert: its parameter, the phase a slot needs to read it directly (None:
        it cannot be, not being plain and contiguous), its bytes."""
        for spec, layer_plans in zip(self.specs, self._plans):
            for step in (s for steps in layer_plans for s in steps):
                target = torch.empty(spec.shapes[step.param], dtype=step.dtype, device="meta")[step.dst]
                direct = step.plain and step.compressed is None and target.is_contiguous()
                yield (step.param, phase_of(step.offset, target.storage_offset() * step.dtype.itemsize) if direct
                       else None, step.span * step.dtype.itemsize)

    def close(self) -> None:
        if self._readers is not None:
            self._readers.shutdown(wait=True)  # no chunk may read a descriptor closed below
        for fd in (*self._fds.values(), *self._direct.values()):
            os.close(fd)
        self._fds, self._direct = {}, {}

    def __enter__(self) -> "ExpertStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------------

    def _check(self, key: Key) -> Key:
        layer, expert = key
        if not (0 <= layer < self.num_layers and 0 <= expert < self.num_experts):
            raise StoreError(f"no expert {key}: the model has {self.num_layers} MoE layers "
                             f"of {self.num_experts} experts")
        return layer, expert

    def _resolve(self, key: str) -> str | None:
        """The weight files' name for checkpoint key `key` (with or without the base model's prefix)."""
        return next((c for c in checkpoint_names(key) if c in self._index), None)

    def _locate(self, key: str) -> _Entry | None:
        found = self._resolve(key)
        return None if found is None else self._index[found]

    def _found(self, key: str) -> bool:
        return self._locate(key) is not None or self._locate(_packed(key)) is not None

    def _compressed(self, key: str, where: str) -> _Compressed:
        """Checkpoint weight `key` stored compressed: its parts located, its shape and scales
        checked (a damaged scale is refused here, before any expert is read)."""
        module = self._resolve(_packed(key))[: -len(PACKED_SUFFIX) - 1]
        if self._schemes is None:
            raise CompressionError(f"{where} is stored compressed ({module}.{PACKED_SUFFIX}) but config.json has no "
                                   "quantization_config")
        scheme = self._schemes.for_module(module, where)
        parts = {}
        for name in compressed_names(scheme.args):
            entry = self._index.get(f"{module}.{name}")
            if entry is None:
                raise CompressionError(f"{where}: {module}.{name} is in none of the weight files")
            parts[name] = entry
        shape = tuple(int(x) for x in self._read_entry(parts.pop("weight_shape")).tolist())
        check_parts(f"{where}: {module}", shape, self._read_entry(parts["weight_scale"]),
                    parts["weight_packed"].shape, scheme.args)
        return _Compressed(module, parts, scheme, shape)

    def _read_entry(self, entry: _Entry) -> torch.Tensor:
        tensor = torch.empty(entry.shape, dtype=entry.dtype)
        with open(entry.path, "rb") as handle:
            handle.seek(entry.offset)
            handle.readinto(memoryview(tensor.view(-1).view(torch.uint8).numpy()))
        return tensor

    def _plan_layer(self, layouts: LayoutDeriver, layer: MoELayer, spec: ExpertSpec,
                    fused: bool) -> list[list[_Step]]:
        pieces: list[Piece] = []
        for revert in (True, False):
            pieces = layouts.pieces(layer, spec, fused, revert)
            if all(self._found(p.at(0).key) for p in pieces):
                break
        else:
            missing = [p.at(0).key for p in pieces if not self._found(p.at(0).key)]
            raise StoreError(f"layer {layer.index} expert 0: tensors {missing} are in none of the weight files "
                             f"of {self.model_dir}; is this the model's own directory?")
        plans = []
        stored_dtypes: dict[str, torch.dtype] = {}  # expert 0's piece key → its dtype
        for expert in range(layer.num_experts):
            steps = []
            for piece in pieces:
                read = piece.at(expert)
                entry = self._locate(read.key)
                where = f"layer {layer.index} expert {expert}: checkpoint tensor {read.key}"
                compressed = None
                if entry is None and self._locate(_packed(read.key)) is not None:
                    compressed = self._compressed(read.key, where)
                    entry = _Entry(compressed.parts["weight_packed"].path, 0, compressed.shape,
                                   spec.dtypes[read.param])
                if entry is None:
                    raise StoreError(f"{where} is in none of the weight files of {self.model_dir}")
                # experts stored in another float dtype than the model computes in (a bf16 checkpoint
                # served in float32) are converted as they are read; every expert stores them alike
                stored = stored_dtypes.setdefault(piece.read.key, entry.dtype)
                converted = entry.dtype.is_floating_point and spec.dtypes[read.param].is_floating_point
                if entry.dtype != stored or (entry.dtype != spec.dtypes[read.param] and not converted):
                    raise StoreError(f"{where} in {entry.path.name} is {entry.dtype}, but the model's experts module "
                                     f"holds {read.param} as {spec.dtypes[read.param]} and expert 0 stores it as "
                                     f"{stored}; load the model with dtype={entry.dtype} (or 'auto')")
                expected = piece.file_shape(spec.counts.get(read.param, layer.num_experts))
                if entry.shape != expected:
                    raise StoreError(f"{where} in {entry.path.name} has shape {list(entry.shape)}, but the model's "
                                     f"experts module ({read.param} {list(spec.shapes[read.param])} per expert) "
                                     f"expects {list(expected)}")
                steps.append(_plan(read, entry, compressed))
            plans.append(steps)
        return plans

    def _fill(self, layer: int, expert: int, out: Mapping[str, torch.Tensor]) -> None:
        """Read expert (layer, expert) from the files into `out`, the tensors of a slot."""
        steps = self._plans[layer][expert]
        if not self.packed:
            for step in steps:
                self._read_step(step, out[step.param])
            return
        for step in steps:
            if step.param not in self.packed:
                self._read_step(step, out[step.param])
        for param, matrix in self.packed.items():
            stored = torch.empty(matrix.out_features, matrix.in_features * matrix.link_bits // 8, dtype=torch.uint8)
            scale = torch.empty(matrix.out_features, matrix.in_features // (matrix.group or matrix.in_features),
                                dtype=KERNEL_DTYPE)
            for step in (s for s in steps if s.param == param):  # whole rows of a compressed weight
                parts = self._read_parts(step.compressed)
                first = step.offset // step.dtype.itemsize // matrix.in_features
                rows = slice(first, first + step.size[0])
                stored[step.dst[0]] = parts["weight_packed"].view(torch.uint8)[rows]
                scale[step.dst[0]] = parts["weight_scale"][rows]
            pack_for_kernel(matrix, stored, scale, out[param], out[param + SCALES_SUFFIX])

    def _packed_matrices(self) -> dict[str, PackedMatrixSpec]:
        """Per weight parameter stored compressed, the matrix a packed slot holds; a
        CompressionError naming the first weight no kernel can run as stored."""
        matrices: dict[str, PackedMatrixSpec] = {}
        for layer, (spec, layer_plans) in enumerate(zip(self.specs, self._plans)):
            steps = [s for expert_steps in layer_plans for s in expert_steps]
            compressed = {s.param for s in steps if s.compressed is not None}
            for step in steps:
                where = f"layer {layer}: expert parameter {step.param}"
                if step.compressed is None:
                    if step.param in compressed:
                        raise CompressionError(f"{where} is stored partly compressed; packed slots need all of it")
                    continue
                args, shape = step.compressed.scheme.args, spec.shapes[step.param]
                matrix = kernel_matrix(args.num_bits, args.symmetric, args.strategy, args.group_size, shape, where)
                in_features = step.compressed.shape[1]
                whole_rows = (len(shape) == 2 and step.order == (0, 1) and step.stride == (in_features, 1)
                              and step.size[1] == in_features == shape[1] and step.dst[1] == slice(0, shape[1], 1)
                              and step.dst[0].step in (None, 1) and (step.offset // step.dtype.itemsize) % in_features == 0)
                if not whole_rows:
                    raise CompressionError(f"{where} {list(shape)} is not laid out as the compressed [out, in] weights' "
                                           "rows (a transposed or fused-in-another-way expert); serve it with "
                                           "--slot-format expanded")
                if matrices.setdefault(step.param, matrix) != matrix:
                    raise CompressionError(f"{where} is grouped as {matrix}, other experts as {matrices[step.param]}; "
                                           "packed slots need one layout per parameter")
        if not matrices:
            raise CompressionError(f"{self.model_dir} stores no expert compressed; packed slots hold int4 or int8 "
                                   "experts (write them with prescient quantize --bits 4)")
        return matrices

    def _read_parts(self, source: _Compressed) -> dict[str, torch.Tensor]:
        """A compressed weight's parts as stored (the bytes that cross the link)."""
        parts = {}
        for name, entry in source.parts.items():
            parts[name] = torch.empty(entry.shape, dtype=entry.dtype)
            self._pread(entry.path, parts[name], entry.offset)
        return parts

    def _read_step(self, step: _Step, tensor: torch.Tensor) -> None:
        target = tensor[step.dst]
        if step.compressed is not None:
            self._expand_step(step, target)
            return
        if step.plain and target.is_contiguous() and target.device.type == "cpu" and target.dtype == step.dtype:
            self._pread(step.path, target, step.offset)
            return
        buffer = torch.empty(step.span, dtype=step.dtype)
        self._pread(step.path, buffer, step.offset)
        view = buffer.as_strided(step.size, step.stride).permute(step.order)
        target.copy_(view.reshape(target.shape))

    def _expand_step(self, step: _Step, target: torch.Tensor) -> None:
        """Read a compressed weight's parts (the bytes that cross the link) and expand them into
        `target`: in place when the step is the whole weight, else through a buffer of its shape."""
        source = step.compressed
        parts = self._read_parts(source)
        whole = step.plain and step.offset == 0 and step.span == math.prod(source.shape)
        if whole and target.is_contiguous() and target.device.type == "cpu" and target.numel() == step.span:
            expand_into(parts, source.scheme.args, target.view(source.shape))
            return
        buffer = expand_into(parts, source.scheme.args, torch.empty(source.shape, dtype=step.dtype))
        first = step.offset // step.dtype.itemsize
        view = buffer.view(-1)[first:first + step.span].as_strided(step.size, step.stride).permute(step.order)
        target.copy_(view.reshape(target.shape))

    def _open_direct(self, paths: set[Path]) -> dict[Path, int]:
        """Descriptors that read `paths` around the page cache (`direct_read`), those the file system
        allows; none for packed slots, or experts under two blocks (their bounce buffers would hold more
        than the expert in flight a buffered read books)."""
        if self.packed or min(spec.nbytes for spec in self.slot_specs) < 2 * ALIGN:
            return {}
        return {path: fd for path in paths if (fd := open_direct(path)) is not None}

    def _pread(self, path: Path, tensor: torch.Tensor, offset: int) -> None:
        """Fill contiguous CPU `tensor` with the file's bytes from `offset` on: around the page cache
        where the store reads directly (in place where the tensor lies at the file's phase, else
        through a bounce buffer), else through it, dropping the pages read."""
        fd = self._fds.get(path)
        if fd is None:
            raise StoreError(f"the expert store of {self.model_dir} is closed")
        memory = memoryview(tensor.view(-1).view(torch.uint8).numpy())
        direct = None if path in self._direct_refused else self._direct.get(path)
        try:
            if self.drop_page_cache and self._host is None and fd not in self._dropped:
                drop_pages(fd)  # the first read: what loading the model's other weights left cached goes
                self._dropped.add(fd)
            if direct is not None and self._read_direct(direct, path, memory, offset, tensor.data_ptr()):
                return
            self._read_chunks(fd, path, memory, offset, _read_fully)
            if self.drop_page_cache and self._host is None:
                drop_pages(fd, offset, len(memory))  # the pages just read
        except OSError as exc:
            raise StoreError(f"reading weight file {path} failed ({exc})") from exc

    def _read_direct(self, direct: int, path: Path, memory: memoryview, offset: int, address: int) -> bool:
        """Read around the page cache: straight into place where `address` lies at the file's phase,
        else through this thread's bounce buffer. False where the file system opened the file with
        `O_DIRECT` but refuses the read (EINVAL): the file is read through the page cache from then on."""
        try:
            if can_read_direct(address, offset):
                start, end = read_edges(direct, memory, offset)
                self._read_chunks(direct, path, memory[start:end], offset + start, _read_fully)
            else:
                self._read_chunks(direct, path, memory, offset, self._read_bounced)
            return True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            log.warning("%s: the file system refused a direct read (%s); reading it through the page cache", path, exc)
            self._direct_refused.add(path)
            return False

    def _read_chunks(self, fd: int, path: Path, memory: memoryview, offset: int,
                     read: Callable[[int, Path, memoryview, int], None]) -> None:
        """`memory` filled from `offset` on by `read`, in `read_depth` chunks read at once where it is
        large enough (each chunk starts a multiple of `CHUNK_ALIGN` after the first, as direct reads need)."""
        chunk = max(-(-len(memory) // self.read_depth // CHUNK_ALIGN) * CHUNK_ALIGN, MIN_CHUNK)
        if self._readers is None or len(memory) <= chunk:
            read(fd, path, memory, offset)
            return
        parts = [self._readers.submit(read, fd, path, memory[start:start + chunk], offset + start)
                 for start in range(0, len(memory), chunk)]
        for part in parts:
            part.result()

    def _read_bounced(self, fd: int, path: Path, memory: memoryview, offset: int) -> None:
        """`read_bounced` through the calling thread's bounce buffer (made at its first use)."""
        bounce = getattr(self._bounces, "buffer", None)
        if bounce is None:
            bounce = self._bounces.buffer = memoryview(mmap.mmap(-1, self.bounce_bytes))
        read_bounced(fd, memory, offset, bounce)

    def _load_host(self, pin: bool) -> None:
        self._host = [spec.empty(self.num_experts, pin=pin) for spec in self.slot_specs]
        keys = [(layer, expert) for layer in range(self.num_layers) for expert in range(self.num_experts)]
        for layer, expert in tqdm(keys, desc="experts → host memory", unit="expert", disable=None):
            self._fill(layer, expert, {name: buffer[expert] for name, buffer in self._host[layer].items()})
        if self.drop_page_cache:
            for fd in self._fds.values():
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        log.info("host store: %d experts, %.1f MiB%s", len(keys), self.total_nbytes / 2**20, " pinned" if pin else "")


def _read_fully(fd: int, path: Path, memory: memoryview, offset: int) -> None:
    """`memory` filled with the file's bytes from `offset` on (pread may return fewer)."""
    done = 0
    while done < len(memory):
        got = os.preadv(fd, [memory[done:]], offset + done)
        if got == 0:
            raise StoreError(f"weight file {path} ends before byte {offset + len(memory)}: it is truncated")
        done += got


def drop_pages(fd: int, offset: int = 0, length: int = 0) -> None:
    """Drop file `fd`'s cached pages over bytes [offset, offset + length), both edge pages whole
    (length 0: the whole file)."""
    if length == 0:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return
    start, end = offset - offset % mmap.PAGESIZE, offset + length
    os.posix_fadvise(fd, start, end - start + -end % mmap.PAGESIZE, os.POSIX_FADV_DONTNEED)


def _packed(key: str) -> str:
    """The packed tensor's key of checkpoint weight `key` (`<module>.weight` → `<module>.weight_packed`)."""
    return key[: -len("weight")] + PACKED_SUFFIX if key.endswith(".weight") else f"{key}.{PACKED_SUFFIX}"


def _packed_spec(spec: ExpertSpec, packed: dict[str, PackedMatrixSpec]) -> ExpertSpec:
    """A packed slot's tensors: each packed parameter's codes and scales_zeros, the rest as the module holds them."""
    shapes, dtypes = {}, {}
    for name, shape in spec.shapes.items():
        if name in packed:
            for suffix, (shape, dtype) in packed[name].slot_tensors().items():
                shapes[name + suffix], dtypes[name + suffix] = shape, dtype
        else:
            shapes[name], dtypes[name] = shape, spec.dtypes[name]
    return ExpertSpec(shapes, dtypes)


def _files(step: _Step) -> set[Path]:
    return {e.path for e in step.compressed.parts.values()} if step.compressed is not None else {step.path}


def _stored_nbytes(steps: list[_Step]) -> int:
    """Bytes read for one expert: each compressed weight once, each plain piece's span."""
    compressed = {step.compressed.module: step.compressed.nbytes for step in steps if step.compressed is not None}
    return sum(compressed.values()) + sum(step.span * step.dtype.itemsize for step in steps if step.compressed is None)
