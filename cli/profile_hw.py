"""`prescient profile-hw`: measure this machine as a hardware profile for `prescient plan
--hardware PROFILE.json` (CPU FLOP/s and memory bandwidth, disk read bandwidth, and the GPU and
pinned host → device link when CUDA is available)."""

from __future__ import annotations

import argparse
import logging

from cli.args import output_file, positive_int

log = logging.getLogger(__name__)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("profile-hw", help="measure this machine as a hardware profile for `prescient plan`")
    p.add_argument("--dir", default=None, help="where to write the temporary disk probe file (default: temp dir)")
    p.add_argument("--disk-mib", type=positive_int, default=256, help="size of the disk probe file")
    p.add_argument("--json", type=output_file, default=None, metavar="OUT", help="write the profile here")
    return p


def run(args: argparse.Namespace) -> dict:
    """Measure, print, write `--json`; returns the profile as a dict."""
    from offload_runtime.planning.hardware import measure_profile

    profile = measure_profile(args.dir, disk_bytes=args.disk_mib * 2**20)
    cpu, gpu = profile.cpu, profile.gpu
    lines = [f"CPU: {cpu.peak_flops / 1e9:.1f} GFLOP/s, memory {cpu.memory_bandwidth / 1e9:.1f} GB/s, "
             f"{cpu.memory_bytes / 2**30:.1f} GiB",
             f"disk → CPU: {profile.disk_to_cpu / 1e9:.2f} GB/s"]
    if gpu is not None:
        lines.append(f"GPU: {gpu.peak_flops / 1e12:.1f} TFLOP/s, memory {gpu.memory_bandwidth / 1e9:.0f} GB/s, "
                     f"{gpu.memory_bytes / 2**30:.1f} GiB; CPU → GPU {profile.cpu_to_gpu / 1e9:.1f} GB/s")
    print("\n".join([*lines, profile.notes]))
    if args.json:
        profile.save(args.json)
        log.info("wrote %s", args.json)
    return profile.to_dict()
