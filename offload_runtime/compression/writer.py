"""`quantize_model`: a model directory in, one with its routed experts compressed out.

The routed experts' checkpoint tensors are found through transformers' own weight conversion (the
names `save_pretrained` writes for the model's experts, e.g. Mixtral's
`block_sparse_moe.experts.{e}.w1.weight`); each becomes compressed-tensors' `pack-quantized`
parts (`weight_packed`, `weight_scale`, `weight_shape`) at 2, 4 or 8 bits, or a bfloat16 copy at
16. The levels are rounded to nearest, or chosen by GPTQ on calibration text
(`offload_runtime.compression.gptq`: the same grid, so the same bytes). Every other tensor (attention, routers, norms, embeddings, shared experts) is copied as it
is, so the output routes exactly as the source and shares its fingerprint: a predictor trained on
the source serves it.

Streaming: one tensor is read at a time (its file mapped only while it is read) and the output
is written in shards of at most `SHARD_BYTES`, so memory holds one shard, never the model (GPTQ
excepted: its calibration runs the whole model, in float32). The output is built in a hidden folder
beside `out` and renamed into place when complete; an interrupted run, or one whose writes fail (a
full disk: an `OutputWriteError`), leaves `out` untouched.
"""

from __future__ import annotations

import ctypes
import logging
import re
import resource
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm
from transformers.core_model_loading import revert_weight_conversion

from offload_runtime.compression.codec import quantize_weight
from offload_runtime.compression.gptq import DAMP, gptq_experts
from offload_runtime.compression.scheme import BITS, config_dict, weight_args
from prescient.arch import find_moe_layers
from prescient.atomic import write_errors, write_json_atomic
from prescient.checkpoint_schemes import CompressionError
from prescient.fingerprint import fingerprint_model_dir
from prescient.loading import load_model
from prescient.model_dir import ModelDirectory, checkpoint_names, tensor_keys

log = logging.getLogger(__name__)

SHARD_BYTES = 256 * 2**20
GROUP_SIZES = (128, 64, 32, 16)  # the default: the largest that divides every expert's input dimension
CHANNEL = "channel"  # --group-size channel: one scale per output row
REPORT = "quantize.json"
METHODS = ("rtn", "gptq")


@dataclass(frozen=True)
class Calibration:
    """The text GPTQ calibrates on: token windows [N, S] and what they are, for the report."""

    source: str
    windows: torch.Tensor


def _fixed_mmap_threshold(size: int = 2**20) -> None:
    """glibc raises its mmap threshold each time a large block is freed, and blocks below it are then
    kept in the heap after they are freed: reading 2 GB of experts one 6 MB tensor at a time held
    2.0 GiB (peak RSS) that way, 0.7 GiB with the threshold fixed (`mallopt(M_MMAP_THRESHOLD)`)."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, size)  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc: its allocator keeps its own counsel
        pass


def expert_keys(model_dir: ModelDirectory) -> dict[str, Path]:
    """The checkpoint keys of the routed experts' tensors and the file holding each."""
    model = model_dir.weightless_model()
    layers = find_moe_layers(model)
    ids = {id(param) for layer in layers for param in layer.experts.parameters()}
    experts = {name: t for name, t in model.state_dict(keep_vars=True).items() if id(t) in ids}
    found = {}
    for name in revert_weight_conversion(model, experts):
        key = model_dir.checkpoint_key(name)
        if key is None:
            raise CompressionError(f"{model_dir}: expert tensor {name} is in none of the weight files")
        found[key] = model_dir.weight_index[key]
    return found


def quantize_model(model_dir: str | Path | ModelDirectory, out: str | Path, bits: int,
                   group_size: int | str | None = None, method: str = "rtn",
                   calibration: Calibration | None = None) -> dict:
    """Write `model_dir` with its routed experts at `bits` (2, 4, 8: group-wise symmetric integers,
    their levels rounded to nearest (`method` "rtn") or chosen by GPTQ on `calibration` ("gptq");
    16: bfloat16) to `out`; returns the report also written as `out/quantize.json`. `group_size`
    None takes the largest of 128, 64, 32, 16 that divides every expert's input dimension; "channel" gives each output row one scale (what torch's int8 kernel
    runs from packed slots). Bad input (an unsupported bit width, a group size that does not
    divide, an already compressed model, an existing `out`) is a CompressionError before any
    file is written."""
    start = time.perf_counter()
    out = Path(out)
    if bits not in BITS:
        raise CompressionError(f"--bits {bits} is not supported; choose one of {', '.join(map(str, BITS))}")
    if method not in METHODS:
        raise CompressionError(f"quantisation method {method!r} is not supported; choose one of {', '.join(METHODS)}")
    if method == "gptq" and (bits == 16 or calibration is None):
        raise CompressionError("--method gptq chooses integer levels on calibration text: it needs --bits 2, 4 or 8"
                               if bits == 16 else "--method gptq needs calibration text")
    source = ModelDirectory.of(model_dir)
    model_dir = source.path
    if "quantization_config" in source.config_dict:
        raise CompressionError(f"{model_dir} is already compressed (its config.json has a quantization_config); "
                               "quantise the uncompressed model")
    if out.exists() and any(out.iterdir()):
        raise CompressionError(f"output directory {out} exists and is not empty; choose another --out or delete it")
    # the experts' weights, one 2-D tensor per expert and projection; their biases stay as they are
    located = expert_keys(source)
    shapes = {key: shape for key, path in located.items() if len(shape := _shape(path, key)) != 1}
    experts = {key: located[key] for key in shapes}
    fused = [key for key, shape in shapes.items() if len(shape) != 2 or not key.endswith(".weight")]
    if fused:
        raise CompressionError(f"{model_dir}: expert tensor {fused[0]} has shape {list(shapes[fused[0]])}; quantize "
                               "compresses checkpoints that store one 2-D weight per expert and projection")
    args = None if bits == 16 else weight_args(bits, _group_size(group_size, shapes))
    chosen = _gptq_levels(source, experts, args, calibration) if method == "gptq" else {}
    _fixed_mmap_threshold()
    work = out.parent / f".{out.name}.partial"
    shutil.rmtree(work, ignore_errors=True)
    with write_errors(out):
        work.mkdir(parents=True)
        try:
            sizes = _write_shards(source.weight_files, experts, args, work, chosen)
            _copy_side_files(source, work, args, experts)
            report = _report(source, work, bits, args, method, sizes)
            if method == "gptq":
                report["calibration"] = {"source": calibration.source, "windows": len(calibration.windows),
                                         "seq_len": calibration.windows.shape[1], "damp": DAMP}
            report["seconds"] = round(time.perf_counter() - start, 2)
            write_json_atomic(work / REPORT, report)
            if out.exists():
                out.rmdir()  # empty, checked above
            work.rename(out)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
    log.info("wrote %s: experts %.1f MiB → %.1f MiB in %.1f s", out, sizes["source_expert_bytes"] / 2**20,
             sizes["expert_bytes"] / 2**20, report["seconds"])
    return report


def _group_size(asked: int | str | None, shapes: dict[str, tuple[int, ...]]) -> int | None:
    """The group size to write (None: one scale per output channel)."""
    inputs = sorted({shape[1] for shape in shapes.values()})
    if asked == CHANNEL:
        return None
    if asked is not None:
        if asked < 1 or any(n % asked for n in inputs):
            raise CompressionError(f"--group-size {asked} does not divide the experts' input dimensions {inputs}")
        return asked
    for size in GROUP_SIZES:
        if all(n % size == 0 for n in inputs):
            return size
    raise CompressionError(f"no group size of {', '.join(map(str, GROUP_SIZES))} divides the experts' input "
                           f"dimensions {inputs}; give --group-size")


def _gptq_levels(model_dir: ModelDirectory, experts: dict[str, Path], args, calibration: Calibration) -> dict[str, torch.Tensor]:
    """GPTQ's chosen weights of every expert tensor, by checkpoint key."""
    model, layers = load_model(model_dir, dtype=torch.float32, experts_implementation="eager")
    chosen = {}
    for name, weight in gptq_experts(model, layers, args, calibration.windows).items():
        key = next((k for k in checkpoint_names(name) if k in experts), None)
        if key is not None:
            chosen[key] = weight
    missing = sorted(set(experts) - set(chosen))
    if missing:
        raise CompressionError(f"--method gptq: expert tensor {missing[0]} is not among the weights the model's "
                               "conversion gives back; use --method rtn")
    return chosen


def _write_shards(files: list[Path], experts: dict[str, Path], args, work: Path,
                  chosen: dict[str, torch.Tensor]) -> dict[str, int]:
    """Every tensor of `files`, experts compressed (at the levels `chosen` gives, by key, where it
    has them: on the source tensor's grid), into shards of at most SHARD_BYTES, and the index."""
    shard: dict[str, torch.Tensor] = {}
    held = 0  # bytes in `shard`
    weight_map: dict[str, str] = {}
    sizes = {"source_expert_bytes": 0, "expert_bytes": 0, "total_bytes": 0}
    names: list[str] = []

    def flush() -> None:
        nonlocal held
        name = f"model-{len(names) + 1:05d}.safetensors"
        save_file(shard, str(work / name), metadata={"format": "pt"})
        names.append(name)
        weight_map.update({key: name for key in shard})
        shard.clear()
        held = 0

    keys = [(path, key) for path in files for key in tensor_keys(path)]
    with tqdm(total=len(experts), desc="quantising experts", unit="tensor", disable=None) as progress:
        for path, key in keys:
            with safe_open(str(path), framework="pt") as handle:
                tensor = handle.get_tensor(key)
            parts = {key: tensor}
            if key in experts:
                sizes["source_expert_bytes"] += tensor.numel() * tensor.element_size()
                parts = ({key: tensor.to(torch.bfloat16)} if args is None else
                         {f"{key[:-len('weight')]}{name}": part
                          for name, part in quantize_weight(chosen.get(key, tensor), args, grid_of=tensor).items()})
            added = sum(t.numel() * t.element_size() for t in parts.values())
            if key in experts:
                sizes["expert_bytes"] += added
                progress.update()
            if shard and held + added > SHARD_BYTES:
                flush()
            shard.update(parts)
            held += added
            sizes["total_bytes"] += added
    if shard:
        flush()
    renamed = {}
    for i, name in enumerate(names):  # the shard count is known only now: name them as save_pretrained does
        final = f"model-{i + 1:05d}-of-{len(names):05d}.safetensors" if len(names) > 1 else "model.safetensors"
        (work / name).rename(work / final)
        renamed[name] = final
    index = {"metadata": {"total_size": sizes["total_bytes"]},
             "weight_map": {key: renamed[name] for key, name in sorted(weight_map.items())}}
    if len(names) > 1:
        write_json_atomic(work / "model.safetensors.index.json", index)
    return sizes


def _copy_side_files(model_dir: ModelDirectory, work: Path, args, experts: dict[str, Path]) -> None:
    """Config (with the quantization_config when compressed), tokenizer and other files."""
    for item in model_dir.path.iterdir():
        if item.is_file() and not item.name.endswith((".safetensors", ".safetensors.index.json")) \
                and item.name != REPORT:
            shutil.copy2(item, work / item.name)
    if args is not None:
        write_json_atomic(work / "config.json",
                          {**model_dir.config_dict, "quantization_config": config_dict(_targets(experts), args)})


def _targets(experts: dict[str, Path]) -> list[str]:
    """Regexes naming the expert modules: each module name with its numbers generalised."""
    modules = {key[: -len(".weight")] for key in experts}
    return sorted({"re:^" + re.sub(r"\d+", r"\\d+", re.escape(m)) + "$" for m in modules})


def _report(model_dir: ModelDirectory, work: Path, bits: int, args, method: str, sizes: dict[str, int]) -> dict:
    """What was written, and the fingerprint check: the output must route as the source."""
    source = fingerprint_model_dir(model_dir)
    written = fingerprint_model_dir(work)
    if written != source:
        raise CompressionError(f"the compressed model's fingerprint {written} differs from the source's {source}; "
                               "a tensor outside the experts changed")
    return {"source": str(model_dir), "fingerprint": source.to_dict(), "bits": bits, "method": method if args else None,
            "group_size": args.group_size if args is not None else None,
            "strategy": args.strategy if args is not None else None, "symmetric": True if args else None,
            "scale_dtype": "bfloat16" if args else None, **sizes,
            "expert_compression": round(sizes["source_expert_bytes"] / max(sizes["expert_bytes"], 1), 3),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def _shape(path: Path, key: str) -> tuple[int, ...]:
    with safe_open(str(path), framework="pt") as handle:
        return tuple(handle.get_slice(key).get_shape())
