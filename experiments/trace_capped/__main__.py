"""`python -m experiments.trace_capped --model runs/tb --caps 0.55GB --repeats 3 --json OUT`: see `run`."""

from __future__ import annotations

import argparse

from experiments.trace_capped.run import TraceInputs, trace_capped
from prescient.budget import parse_memory
from prescient.errors import CapacityError


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m experiments.trace_capped", description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--caps", required=True, help="comma list of memory caps, e.g. 0.55GB,0.65GB")
    p.add_argument("--dataset", default="stdlib-code")
    p.add_argument("--split", default="validation")
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a run is killed")
    p.add_argument("--json", required=True)
    args = p.parse_args()
    try:
        caps = [parse_memory(text) for text in args.caps.split(",")]
    except CapacityError as exc:
        p.error(str(exc))
    inputs = TraceInputs(args.model, args.dataset, args.split, args.max_tokens, args.seq_len, args.batch_size)
    result = trace_capped(inputs, caps, args.json, repeats=args.repeats, timeout_s=args.timeout)
    for name, entry in result["summary"].items():
        wall = entry["wall_s"]
        print(f"{name}: {entry['ok']}/{entry['runs']} ran, killed {entry['killed']}, routing equal "
              f"{entry['routing_equal']}, wall {wall and wall['median']} s [{wall and wall['min']}-"
              f"{wall and wall['max']}], ratio to resident {entry.get('wall_ratio_to_resident')}")


if __name__ == "__main__":
    main()
