"""`prescient plan`: choose a MoE-Lightning policy (N, μ, attention place, r_w, r_c) for a model,
hardware and workload with the HRM; print it with its predicted throughput, and write the
policy, prediction, per-layer time breakdown, memory use and the inputs as JSON with `--json`.

Wired into `prescient.cli` with `add_parser(sub)` and `run(args)`.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging

from prescient.atomic import write_json_atomic

log = logging.getLogger(__name__)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plan", help="choose an offloading policy with the HRM performance model")
    p.add_argument("--hardware", required=True, help="a preset (t4, l4, a100, h100, t4-pcie4, ...) or a profile JSON")
    p.add_argument("--model", required=True, help="a config.json or a model directory holding one")
    p.add_argument("--prompt-len", type=int, required=True)
    p.add_argument("--gen-len", type=int, required=True)
    p.add_argument("--cpu-memory", default=None, metavar="SIZE", help="override the profile's CPU memory, e.g. 192GiB")
    p.add_argument("--memory-budget", default=None, metavar="SIZE",
                   help="cap on expert bytes in the compute device's memory (resident + double buffer), e.g. 2GiB")
    p.add_argument("--max-requests", type=int, default=4096, help="largest batch N searched")
    p.add_argument("--max-micro-batch", type=int, default=256, help="largest micro-batch μ searched")
    p.add_argument("--rw-step", type=float, default=0.01, help="grid step of r_w")
    p.add_argument("--rc-step", type=float, default=0.1, help="grid step of r_c")
    p.add_argument("--json", default=None, metavar="OUT", help="write the plan here")
    return p


def run(args: argparse.Namespace) -> dict:
    """Search, print, write `--json`; returns the JSON record."""
    from offload_runtime.hardware import load_profile, parse_size
    from offload_runtime.hrm import ModelSpec, Workload
    from offload_runtime.planner import SearchSpace, search

    hardware = load_profile(args.hardware)
    if args.cpu_memory:
        hardware = hardware.with_cpu_memory(parse_size(args.cpu_memory))
    budget = parse_size(args.memory_budget) if args.memory_budget else None
    spec = ModelSpec.from_config(args.model)
    workload = Workload(args.prompt_len, args.gen_len)
    space = SearchSpace(max_requests=args.max_requests, max_micro_batch=args.max_micro_batch,
                        rw_step=args.rw_step, rc_step=args.rc_step)
    plan = search(spec, hardware, workload, expert_budget_bytes=budget, space=space)
    record = {
        "hardware": hardware.to_dict(),
        "model": {"config": str(args.model), **spec.to_dict()},
        "workload": {"prompt_len": workload.prompt_len, "gen_len": workload.gen_len},
        "expert_budget_bytes": budget,
        "search": {**space.to_dict(), "feasible_evaluated": plan.feasible_evaluated},
        "memory": {"use": dataclasses.asdict(plan.usage), "gpu_bytes": hardware.gpu and hardware.gpu.memory_bytes,
                   "cpu_bytes": hardware.cpu.memory_bytes},
        **plan.best.to_dict(),
    }
    print(_summary(record))
    if args.json:
        write_json_atomic(args.json, record)
        log.info("wrote %s", args.json)
    return record


def _summary(record: dict) -> str:
    p, step, prefill = record["policy"], record["decode_step"], record["prefill"]
    tiers = ", ".join(f"{tier} {seconds * 1e3:.1f} ms" for tier, seconds in step["tiers"].items())
    use = record["memory"]["use"]
    memory = f"CPU {use['cpu'] / 2**30:.1f} GiB" + (f", GPU {use['gpu'] / 2**30:.1f} GiB" if use["gpu"] else "")
    return "\n".join([
        f"{record['model']['name']} on {record['hardware']['name']}, prompt {record['workload']['prompt_len']} + "
        f"generate {record['workload']['gen_len']}",
        f"policy: N={p['n_requests']} in {p['n_requests'] // p['micro_batch']} micro-batches of μ={p['micro_batch']}, "
        f"attention on {p['attention_on']}, FFN on {p['ffn_on']}, r_w={p['r_w']:g}, r_c={p['r_c']:g}",
        f"predicted: {record['tokens_per_s']:.1f} tokens/s with prefill, {record['decode_tokens_per_s']:.1f} "
        f"tokens/s decode only",
        f"decode layer: T = {step['layer_seconds'] * 1e3:.1f} ms ({step['bottleneck']}-bound; {tiers}); "
        f"step {step['seconds']:.2f} s, prefill {prefill['seconds']:.1f} s",
        f"memory: {memory}",
    ])
