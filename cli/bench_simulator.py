"""`prescient bench-simulator`: the simulator's accesses per second, per policy, on a synthetic
trace; see `experiments.bench_simulator`."""

from __future__ import annotations

import argparse

from cli.args import Renamed, chance, output_file, positive_int, seed
from cli.commands import add_command


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = add_command(subparsers, "bench-simulator")
    p.add_argument("out", type=output_file, help="JSON file to write")
    p.add_argument("--tokens", type=positive_int, default=50_000)
    p.add_argument("--layers", type=positive_int, default=8)
    p.add_argument("--experts", type=positive_int, default=64)
    p.add_argument("--top-k", type=positive_int, default=2)
    p.add_argument("--top-t", type=positive_int, default=8)
    p.add_argument("--seq-len", type=positive_int, default=512)
    p.add_argument("--repeat", type=chance, default=0.5, help="chance a layer's logits lean on the previous token's")
    p.add_argument("--capacity", type=positive_int, default=None, help="slots in all (default L*E/4)")
    p.add_argument("--layers-ahead", "--horizon", type=positive_int, default=1, action=Renamed, deprecated="--horizon",
                   help="prefetch this many layers ahead (--horizon: its old name)")
    p.add_argument("--transfer-per-step", type=int, default=4)
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--runs", type=positive_int, default=3, help="timed runs per policy; the best counts")
    return p


def run(args: argparse.Namespace) -> dict:
    from experiments.bench_simulator import bench_simulator
    from prescient.atomic import write_results

    settings = {k: v for k, v in vars(args).items() if k not in ("command", "out")}
    report = bench_simulator(**settings)
    write_results(report, args.out)
    return report
