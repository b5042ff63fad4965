"""`prescient profile-hw`: measure this machine as a hardware profile for `prescient plan
--hardware PROFILE.json` (CPU FLOP/s and memory bandwidth, disk read bandwidth, and the GPU and
pinned host → device link when CUDA is available), and the link as the runtime uses it: cold
random reads of one expert's stored bytes at queue depths 1 to 16 (`--model DIR`: reading that
model's safetensors file), the depth `--transfer-workers auto` keeps."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os

from cli.args import list_of, output_file, positive_int
from cli.commands import add_command

log = logging.getLogger(__name__)


def queue_depth(text: str) -> int:
    from offload_runtime.engine.options import MAX_TRANSFER_WORKERS

    depth = positive_int(text)
    if depth > MAX_TRANSFER_WORKERS:
        raise argparse.ArgumentTypeError(f"queue depth {depth} is out of range: give 1 to {MAX_TRANSFER_WORKERS}")
    return depth


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = add_command(subparsers, "profile-hw")
    p.add_argument("--dir", default=None, help="where to write the temporary disk probe files (default: temp dir)")
    p.add_argument("--disk-mib", type=positive_int, default=256, help="size of the disk probe file")
    p.add_argument("--model", metavar="DIR", default=None,
                   help="time random reads of this model's expert size in its own safetensors file (default: a "
                        "temporary file and 2 MiB reads)")
    p.add_argument("--depths", type=list_of(queue_depth), default=(1, 2, 4, 8, 16),
                   help="queue depths (reads in flight) of the random-read curve (default 1,2,4,8,16)")
    p.add_argument("--repeats", type=positive_int, default=5,
                   help="interleaved repeats of the random-read curve; each depth's rate is their median")
    p.add_argument("--reads", type=positive_int, default=48, help="random reads per depth and repeat")
    p.add_argument("--json", type=output_file, default=None, metavar="OUT", help="write the profile here")
    return p


def run(args: argparse.Namespace) -> dict:
    """Measure, print, write `--json`; returns the profile as a dict."""
    from offload_runtime.planning.hardware import measure_profile
    from offload_runtime.planning.link_profile import DEFAULT_EXPERT_BYTES, measure_random_reads, model_read_file

    path, expert_bytes = model_read_file(args.model) if args.model else (None, DEFAULT_EXPERT_BYTES)
    load_before = os.getloadavg()[0]
    curve = measure_random_reads(path, expert_bytes, depths=args.depths, repeats=args.repeats, reads=args.reads,
                                 directory=args.dir, file_bytes=args.disk_mib * 2**20)
    profile = measure_profile(args.dir, disk_bytes=args.disk_mib * 2**20)
    load = (f"1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after, on {os.cpu_count()} CPUs "
            "(above about 1, other processes shared the machine during the measurement)")
    profile = dataclasses.replace(profile, random_reads=curve, notes=f"{profile.notes}; random reads: {load}")
    cpu, gpu = profile.cpu, profile.gpu
    lines = [f"CPU: {cpu.peak_flops / 1e9:.1f} GFLOP/s, memory {cpu.memory_bandwidth / 1e9:.1f} GB/s, "
             f"{cpu.memory_bytes / 2**30:.1f} GiB",
             f"disk → CPU: {profile.disk_to_cpu / 1e9:.2f} GB/s sequential",
             f"random {curve.expert_bytes / 1e6:.2f} MB reads, cold, GB/s by reads in flight: "
             + ", ".join(f"{d}: {r / 1e9:.2f}" for d, r in zip(curve.depths, curve.bytes_per_s))
             + f"; chosen depth {curve.depth} (the smallest within 5% of the best)"]
    if gpu is not None:
        lines.append(f"GPU: {gpu.peak_flops / 1e12:.1f} TFLOP/s, memory {gpu.memory_bandwidth / 1e9:.0f} GB/s, "
                     f"{gpu.memory_bytes / 2**30:.1f} GiB; CPU → GPU {profile.cpu_to_gpu / 1e9:.1f} GB/s")
    print("\n".join([*lines, profile.notes]))
    if args.json:
        profile.save(args.json)
        log.info("wrote %s", args.json)
    return profile.to_dict()
