"""`prescient bench-replicas`: the expert hit rate of serving replicas under a multi-turn chat
workload, routed cache-aware, at random, by the least loaded, against one server (see
`experiments.bench_replicas`); `--backend ray` on a local Ray cluster (the extra `[ray]`),
`inprocess` without Ray."""

from __future__ import annotations

import argparse

from cli.args import add_runtime_args, memory, output_file, port, positive_int, runtime_options
from cli.commands import add_command


def settings(text: str) -> tuple[str, ...]:
    """`single,random,cache`: the routings to measure."""
    from experiments.bench_replicas import SETTINGS

    chosen = tuple(s for s in text.split(",") if s)
    unknown = [s for s in chosen if s not in SETTINGS]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"settings are a comma list of {','.join(SETTINGS)}, not {text!r}")
    return chosen


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = add_command(subparsers, "bench-replicas")
    p.add_argument("--model", required=True, help="Hugging Face model directory (decoder-only)")
    p.add_argument("--predictor", default=None, help="predictor artifact (NAME, NAME.json or NAME.safetensors)")
    add_runtime_args(p, "policy", "budget", "dtype")
    p.add_argument("--backend", choices=("ray", "inprocess"), default="ray",
                   help="ray: replicas on a local Ray cluster; inprocess: the replicas' apps in this process")
    p.add_argument("--replicas", type=positive_int, default=2, help="replicas of the routed settings")
    p.add_argument("--settings", default=None, type=settings,
                   help="comma list of single,random,least-loaded,cache (default: all four)")
    p.add_argument("--conversations", type=positive_int, default=8, help="chats running at once")
    p.add_argument("--turns", type=positive_int, default=4, help="user turns per chat")
    p.add_argument("--max-tokens", type=positive_int, default=24, help="tokens per answer")
    p.add_argument("--repeats", type=positive_int, default=1,
                   help="runs of every setting, interleaved (the summary gives medians and ranges)")
    p.add_argument("--max-batch", type=positive_int, default=16, help="each replica's --max-batch")
    p.add_argument("--prefix-cache", type=memory, default=None, metavar="SIZE",
                   help="keep finished sequences' KV (up to SIZE, e.g. 64MiB; per replica and the single server) so that a prompt "
                        "resuming one (a chat's next turn) prefills only its new tokens; default: off")
    p.add_argument("--port", type=port, default=8000, help="Ray's HTTP proxy (--backend ray)")
    p.add_argument("--json", type=output_file, required=True, metavar="OUT", help="the results JSON")
    return p


def run(args: argparse.Namespace) -> None:
    from experiments.bench_replicas import bench_replicas

    app_args = dict(model_dir=args.model, predictor=args.predictor, options=runtime_options(args),
                    max_batch=args.max_batch, prefix_cache_bytes=args.prefix_cache or 0)
    result = bench_replicas(app_args, args.json, backend=args.backend, replicas=args.replicas,
                            conversations=args.conversations, turns=args.turns, max_tokens=args.max_tokens,
                            port=args.port, repeats=args.repeats,
                            **({"settings": args.settings} if args.settings else {}))
    for name, rate in result["summary"]["hit_rate"].items():
        median = result["summary"]["median"]
        print(f"{name:>12}: expert hit rate {rate:.4f}, {median['prefill_tokens'][name]:.0f} prompt tokens prefilled, "
              f"{median['tokens_per_s'][name]:.2f} tokens/s (medians)")
    print(json_line(result["summary"]))


def json_line(summary: dict) -> str:
    import json

    return json.dumps({k: v for k, v in summary.items() if k not in ("hit_rate", "median", "range")})
