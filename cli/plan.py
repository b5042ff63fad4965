"""`prescient plan`: choose a MoE-Lightning policy (N, μ, attention place, FFN place, r_w, r_c) for a model,
hardware and workload with the HRM; print it with its predicted throughput, and write the
policy, prediction, per-layer time breakdown, memory use and the inputs as JSON with `--json`.
With `--schedule klotski`: Klotski's group size n (and K) for a model directory, from times
measured on this machine (`offload_runtime.planning.klotski_plan`)."""

from __future__ import annotations

import argparse

from cli.args import non_negative_int, output_file, positive_int, share
from cli.commands import add_command
from prescient.errors import PrescientError


class PlanArgumentError(PrescientError):
    """A plan was asked for without what its schedule needs."""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = add_command(subparsers, "plan")
    p.add_argument("--schedule", choices=("cgopipe", "klotski"), default="cgopipe",
                   help="cgopipe: MoE-Lightning's policy search with the HRM (needs --hardware); klotski: Klotski's "
                        "group size from times measured with the model's weights on this machine")
    p.add_argument("--hardware", help="a preset (t4, l4, a100, h100, t4-pcie4, ...) or a profile JSON "
                                      "(klotski: default, this machine measured)")
    p.add_argument("--model", required=True, help="a config.json or a model directory holding one (klotski: a model "
                                                  "directory with its weights)")
    p.add_argument("--prompt-len", type=positive_int, required=True)
    p.add_argument("--gen-len", type=positive_int, required=True)
    p.add_argument("--cpu-memory", default=None, metavar="SIZE", help="override the profile's CPU memory, e.g. 192GiB")
    p.add_argument("--memory-budget", default=None, metavar="SIZE",
                   help="cap on expert bytes in the compute device's memory (resident + double buffer), e.g. 2GiB")
    p.add_argument("--max-requests", type=positive_int, default=4096, help="largest batch N searched")
    p.add_argument("--max-micro-batch", type=positive_int, default=256, help="largest micro-batch μ searched")
    p.add_argument("--rw-step", type=float, default=0.01, help="grid step of r_w")
    p.add_argument("--rc-step", type=float, default=0.1, help="grid step of r_c")
    klotski = p.add_argument_group("klotski")
    klotski.add_argument("--micro-batch", type=positive_int, default=4, help="requests per batch of the group")
    klotski.add_argument("--resident", type=share, default=0.5, help="r_w: share of each layer's experts kept resident")
    klotski.add_argument("--memory", default=None, metavar="SIZE",
                         help="memory for weights, expert slots and the group's KV caches (default: this machine's)")
    klotski.add_argument("--max-group", type=positive_int, default=64, help="largest group size n considered")
    klotski.add_argument("--hot-count", type=non_negative_int, default=None, help="K hot experts (default: the planner picks)")
    klotski.add_argument("--trace", help="a trace of the model whose expert shares the planner uses (default: uniform)")
    p.add_argument("--json", type=output_file, default=None, metavar="OUT", help="write the plan here")
    return p


def run(args: argparse.Namespace) -> dict:
    """Search (or, for Klotski, measure and solve), print, write `--json`; returns the JSON record."""
    from prescient.atomic import write_results

    record = klotski(args) if args.schedule == "klotski" else cgopipe(args)
    if args.json:
        write_results(record, args.json)
    return record


def klotski(args: argparse.Namespace) -> dict:
    import psutil

    from offload_runtime.planning.hardware import load_profile, parse_size
    from offload_runtime.planning.hrm import Workload
    from offload_runtime.planning.klotski_plan import klotski_plan

    memory = parse_size(args.memory) if args.memory else psutil.virtual_memory().total
    record = klotski_plan(args.model, args.micro_batch, args.resident, Workload(args.prompt_len, args.gen_len),
                          memory, args.max_group, load_profile(args.hardware) if args.hardware else None, args.trace,
                          args.hot_count)
    verdict = "no bubble" if record["bubble_free"] else "bubbles remain (no n up to the largest group meets 4-7)"
    times = record["times"]
    print(f"Klotski: groups of n={record['group_size']} batches of {args.micro_batch} requests, K={record['hot_count']} "
          f"hot experts per layer: {verdict}; memory holds up to n={record['memory']['largest_group']}")
    print(f"measured: attention {times['attention'] * 1e3:.2f} ms, gate {times['gate'] * 1e3:.2f} ms per batch; an "
          f"expert {times['expert_fixed'] * 1e3:.2f} ms + {times['expert_per_token'] * 1e3:.3f} ms/token, its copy "
          f"{times['io_expert'] * 1e3:.2f} ms")
    return record


def cgopipe(args: argparse.Namespace) -> dict:
    from offload_runtime.planning.plan import make_plan
    from offload_runtime.planning.planner import SearchSpace

    if args.hardware is None:
        raise PlanArgumentError("--hardware is needed for --schedule cgopipe (a preset such as t4, or a profile JSON)")
    space = SearchSpace(max_requests=args.max_requests, max_micro_batch=args.max_micro_batch,
                        rw_step=args.rw_step, rc_step=args.rc_step)
    record = make_plan(args.hardware, args.model, args.prompt_len, args.gen_len, cpu_memory=args.cpu_memory,
                       memory_budget=args.memory_budget, space=space)
    print(summary(record))
    return record


def summary(record: dict) -> str:
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
        *([turning(record["turning_points"])] if record["turning_points"] else []),
    ])


def turning(points: dict) -> str:
    """MoE-Lightning's turning points of the FFN, in one line."""
    where = {"cpu": "better on the CPU (F_g=0)", "link": "bound by the CPU→GPU link", "gpu": "bound by the GPU"}
    return (f"FFN intensity {points['intensity_cpu']:.1f} FLOP/byte of streamed experts: {where[points['region']]} "
            f"(turning points P1 {points['p1']:.1f}, P2 {points['p2']:.1f}; balance {points['balance']:.2f}, 1 = balanced)")
