"""Hardware profiles for the HRM performance model: what each processor can compute and move.

A `HardwareProfile` is a CPU, an optional GPU and the links between the memory tiers:
`cpu_to_gpu` (PCIe, host → device) and `disk_to_cpu` (the slow tier of a machine without GPU;
sequential reads), with `random_reads`, when measured, the random expert-sized reads the runtime
makes at each queue depth (`read_curve.ReadCurve`).
Presets describe the GPUs of the MoE-Lightning paper and newer ones (`preset_names()`); a profile
can also be measured on this machine (`measure_profile`) and kept as JSON (`save`,
`load_profile`).

All numbers are SI: FLOP/s, bytes/s, bytes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from offload_runtime.planning.read_curve import ReadCurve
from prescient.atomic import write_json_atomic
from prescient.errors import PrescientError
from prescient.budget import parse_bytes

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

GB = 10**9
TFLOPS = 10**12

class HardwareError(PrescientError):
    """A hardware profile name, file or size cannot be read."""


@dataclass(frozen=True)
class Processor:
    """One compute level of the hierarchy and the memory next to it."""

    peak_flops: float        # FLOP/s
    memory_bandwidth: float  # bytes/s, this processor reading its own memory
    memory_bytes: float      # capacity of that memory


@dataclass(frozen=True)
class HardwareProfile:
    """A machine as the HRM sees it. Without a GPU the CPU computes everything and the slow
    tier is the disk (`disk_to_cpu`); with one, the slow tier is CPU memory (`cpu_to_gpu`)."""

    name: str
    cpu: Processor
    gpu: Processor | None = None
    cpu_to_gpu: float | None = None  # bytes/s, pinned host → device
    disk_to_cpu: float = 2 * GB      # bytes/s, cold reads
    notes: str = ""
    random_reads: ReadCurve | None = None  # cold expert-sized random reads per queue depth

    def __post_init__(self) -> None:
        if (self.gpu is None) != (self.cpu_to_gpu is None):
            raise HardwareError(f"profile {self.name!r}: give both `gpu` and `cpu_to_gpu`, or neither")

    @property
    def link_bandwidth(self) -> float:
        """Bytes/s into the compute device's memory from the tier below it (from disk: the
        random-read rate at the depth the runtime keeps, when measured)."""
        if self.cpu_to_gpu is not None:
            return self.cpu_to_gpu
        return self.random_reads.rate if self.random_reads is not None else self.disk_to_cpu

    def with_cpu_memory(self, memory_bytes: float) -> HardwareProfile:
        return dataclasses.replace(self, cpu=dataclasses.replace(self.cpu, memory_bytes=memory_bytes))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HardwareProfile:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown or "name" not in data or "cpu" not in data:
            raise HardwareError(f"a hardware profile needs 'name' and 'cpu' and takes only {sorted(fields)}; "
                                f"got keys {sorted(data)}")
        kwargs = dict(data)
        try:
            kwargs["cpu"] = Processor(**data["cpu"])
            kwargs["gpu"] = Processor(**data["gpu"]) if data.get("gpu") else None
            kwargs["random_reads"] = ReadCurve.from_dict(data["random_reads"]) if data.get("random_reads") else None
        except TypeError as exc:
            raise HardwareError(f"processor of profile {data['name']!r}: {exc}; it needs exactly "
                                "peak_flops, memory_bandwidth and memory_bytes") from None
        return cls(**kwargs)

    def save(self, path: str | Path) -> Path:
        return write_json_atomic(path, self.to_dict())


# Vendor data-sheet GPU numbers (dense tensor-core FP16/BF16 FLOP/s, memory bandwidth, capacity).
_GPUS: dict[str, tuple[Processor, int, str]] = {
    "t4": (Processor(65 * TFLOPS, 320 * GB, 16 * GB), 3, "NVIDIA T4 16 GB (fp16 tensor)"),
    "l4": (Processor(121 * TFLOPS, 300 * GB, 24 * GB), 4, "NVIDIA L4 24 GB (fp16 dense)"),
    "a100": (Processor(312 * TFLOPS, 1555 * GB, 40 * GB), 4, "NVIDIA A100 40 GB (bf16 dense)"),
    "a100-80gb": (Processor(312 * TFLOPS, 1935 * GB, 80 * GB), 4, "NVIDIA A100 80 GB PCIe (bf16 dense)"),
    "h100": (Processor(989 * TFLOPS, 3350 * GB, 80 * GB), 5, "NVIDIA H100 SXM 80 GB (bf16 dense)"),
    "h100-pcie": (Processor(756 * TFLOPS, 2000 * GB, 80 * GB), 5, "NVIDIA H100 PCIe 80 GB (bf16 dense)"),
}

# Effective pinned host → device bandwidth of a x16 link. Theoretical: 15.75 / 31.5 / 63 GB/s
# for PCIe 3 / 4 / 5; cudaMemcpy from pinned memory reaches about 80 % of that in practice
# (bandwidthTest on T4 hosts shows ~12-13 GB/s, on PCIe 4 hosts ~25 GB/s, on H100 ~50 GB/s).
_PCIE = {3: 12.5 * GB, 4: 25 * GB, 5: 50 * GB}

# The host of the paper's S1/S2 settings (Table 2: Intel Xeon 2.2-2.3 GHz, 24 cores, 192 GB).
# FLOP/s and bandwidth are the paper's own base CPU of §6.3 (1.6 TFLOP/s; 100 GB/s; the text
# swaps the labels of bandwidth and capacity): 24 cores × 2.3 GHz × 32 fp32 FLOP/cycle
# (two AVX2 FMA units) = 1.77 TFLOP/s peak agrees.
_PAPER_HOST = Processor(1.6 * TFLOPS, 100 * GB, 192 * GB)
# A local NVMe SSD reading cold data; only a profile without GPU uses it in the model.
_NVME = 2 * GB


def _presets() -> dict[str, HardwareProfile]:
    presets = {}
    for gpu_name, (gpu, default_gen, what) in _GPUS.items():
        for gen, bandwidth in _PCIE.items():
            name = gpu_name if gen == default_gen else f"{gpu_name}-pcie{gen}"
            presets[name] = HardwareProfile(
                name=name, cpu=_PAPER_HOST, gpu=gpu, cpu_to_gpu=bandwidth, disk_to_cpu=_NVME,
                notes=f"{what}, PCIe {gen} x16 (effective); host: MoE-Lightning S1/S2 Xeon, 192 GB")
    return presets


PRESETS: dict[str, HardwareProfile] = _presets()


def preset_names() -> list[str]:
    return sorted(PRESETS)


def load_profile(name_or_path: str | Path) -> HardwareProfile:
    """A preset by name (`t4`, `l4-pcie5`, ...) or a profile JSON written by `save` or
    `prescient profile-hw --json`."""
    text = str(name_or_path)
    if text in PRESETS:
        return PRESETS[text]
    path = Path(text)
    if path.suffix == ".json" or path.is_file():
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise HardwareError(f"hardware profile {path} does not exist; write one with "
                                "`prescient profile-hw --json PATH` or name a preset") from None
        except json.JSONDecodeError as exc:
            raise HardwareError(f"hardware profile {path} is not JSON ({exc})") from None
        return HardwareProfile.from_dict(data)
    raise HardwareError(f"unknown hardware {text!r}: name a preset ({', '.join(preset_names())}) "
                        "or a profile JSON file")


def parse_size(text: str) -> int:
    """Bytes from "192GiB", "16GB", "512MiB" or a plain number of bytes."""
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise HardwareError(str(exc)) from None


def measure_profile(directory: str | Path | None = None, *, disk_bytes: int = 256 * 2**20,
                    copy_bytes: int = 256 * 2**20, matmul_size: int = 2048, repeats: int = 3) -> HardwareProfile:
    """Measure this machine with `torch.get_num_threads()` threads: CPU FLOP/s from a float32
    matmul, CPU memory bandwidth from a tensor copy (read + write bytes), disk read bandwidth
    from a `disk_bytes` temporary file in `directory` read back cold; with CUDA also the GPU's
    bf16 (else fp16) matmul, its memory bandwidth and the pinned host → device copy. Each
    figure is the best of `repeats` timed runs after one warm-up."""
    import psutil
    import torch

    cpu_dev = torch.device("cpu")
    cpu = Processor(peak_flops=_matmul_flops(cpu_dev, torch.float32, matmul_size, repeats),
                    memory_bandwidth=_copy_bandwidth(cpu_dev, copy_bytes, repeats),
                    memory_bytes=psutil.virtual_memory().total)
    disk, dropped = _disk_read_bandwidth(Path(directory or tempfile.gettempdir()), disk_bytes)
    notes = [f"CPU: {_cpu_model()}, {torch.get_num_threads()} torch threads, float32 matmul {matmul_size}",
             f"disk: {disk_bytes / 2**20:.0f} MiB in {directory or tempfile.gettempdir()}, "
             + ("page cache dropped" if dropped else "page cache NOT dropped (no posix_fadvise): an upper bound")]
    gpu = link = None
    if torch.cuda.is_available():
        dev = torch.device("cuda")
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        gpu = Processor(peak_flops=_matmul_flops(dev, dtype, 8192, repeats),
                        memory_bandwidth=_copy_bandwidth(dev, 4 * copy_bytes, repeats),
                        memory_bytes=torch.cuda.get_device_properties(dev).total_memory)
        link = _pinned_copy_bandwidth(dev, copy_bytes, repeats)
        notes.append(f"GPU: {torch.cuda.get_device_name(dev)}, {dtype} matmul 8192, pinned copy")
    profile = HardwareProfile(name="this-machine", cpu=cpu, gpu=gpu, cpu_to_gpu=link, disk_to_cpu=disk,
                              notes="; ".join(notes))
    log.info("measured %s", profile)
    return profile


def _best_seconds(fn: Any, device: torch.device, repeats: int) -> float:
    import torch

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()  # warm-up: first-touch page faults, kernel selection
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def _matmul_flops(device: torch.device, dtype: torch.dtype, n: int, repeats: int) -> float:
    import torch

    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    return 2 * n**3 / _best_seconds(lambda: torch.mm(a, b, out=out), device, repeats)


def _copy_bandwidth(device: torch.device, nbytes: int, repeats: int) -> float:
    import torch

    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / _best_seconds(lambda: dst.copy_(src), device, repeats)  # read + write


def _pinned_copy_bandwidth(device: torch.device, nbytes: int, repeats: int) -> float:
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return nbytes / _best_seconds(lambda: dst.copy_(src, non_blocking=True), device, repeats)


def _disk_read_bandwidth(directory: Path, nbytes: int) -> tuple[float, bool]:
    """Write `nbytes` of random data, fsync, drop the file from the page cache, read it back;
    returns (bytes/s, whether the page cache was dropped)."""
    chunk = os.urandom(min(nbytes, 16 * 2**20))
    dropped = hasattr(os, "posix_fadvise")
    fd, path = tempfile.mkstemp(prefix=".prescient-disk-probe-", dir=directory)
    try:
        with os.fdopen(fd, "wb", buffering=0) as f:
            written = 0
            while written < nbytes:
                written += f.write(chunk[: nbytes - written])
            os.fsync(f.fileno())
            if dropped:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        buffer = memoryview(bytearray(len(chunk)))
        start = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass
        seconds = time.perf_counter() - start
    finally:
        os.unlink(path)
    return nbytes / seconds, dropped


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
