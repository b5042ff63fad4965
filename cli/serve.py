"""`prescient serve`: an OpenAI-compatible HTTP server over the offloading runtime (see
`offload_runtime.server`): completions and chat (streamed or not), /v1/models, /health and
Prometheus /metrics of the expert cache and the predictor. Stops gracefully on SIGTERM or Ctrl-C.
Beyond loopback: `--api-key` (or PRESCIENT_API_KEY, kept out of the process list) and HTTPS with
`--ssl-keyfile` / `--ssl-certfile`. `--replicas N` serves N replicas on Ray Serve (the extra `[ray]`;
see `offload_runtime.server.ray_replicas`), a conversation kept on the replica that holds its experts."""

from __future__ import annotations

import argparse
import os

from cli.args import add_predictor_arg, add_runtime_args, memory, port, positive_int, runtime_options, seconds, threads
from cli.commands import add_command

API_KEY_ENV = "PRESCIENT_API_KEY"


def api_keys(text: str) -> tuple[str, ...]:
    """`KEY[,KEY...]`: the keys a client may send as `Authorization: Bearer KEY`. Errors never echo a key."""
    keys = tuple(text.split(","))
    for n, key in enumerate(keys, 1):
        if not key or not key.isascii() or not key.isprintable() or any(c.isspace() for c in key):
            raise argparse.ArgumentTypeError(
                f"key {n} of {len(keys)} is empty, or holds a space or a character that is not printable ASCII, "
                f"which a bearer token cannot carry; give keys of printable ASCII (from --api-key or {API_KEY_ENV})")
    return keys


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = add_command(subparsers, "serve")
    p.add_argument("--model", required=True, help="Hugging Face model directory (decoder-only)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the model directory's name)")
    predictor = add_predictor_arg(p)
    requests = p.add_argument_group("requests", "how many are decoded together, wait, and how they end")
    requests.add_argument("--max-batch", type=positive_int, default=16, help="requests decoded together")
    requests.add_argument("--max-queue", type=positive_int, default=64,
                          help="requests waiting for the batch; more are refused with 429 and Retry-After")
    requests.add_argument("--shutdown-timeout", type=seconds, default=30.0,
                          help="seconds in-flight requests get to finish after SIGTERM / Ctrl-C")
    requests.add_argument("--prefix-cache", type=memory, default=None, metavar="SIZE",
                          help="keep finished sequences' KV (up to SIZE, e.g. 64MiB; per replica) so that a prompt "
                               "resuming one (a chat's next turn) prefills only its new tokens; default: off")
    access = p.add_argument_group("access", "who may call, and over what (beyond loopback)")
    access.add_argument("--api-key", type=api_keys, default=os.environ.get(API_KEY_ENV) or None,
                        metavar="KEY[,KEY...]",
                        help="answer /v1 routes only to clients sending `Authorization: Bearer KEY` (others get 401); "
                             f"default: ${API_KEY_ENV}, which keeps the keys out of the process list")
    access.add_argument("--metrics-need-key", action="store_true",
                        help="put /metrics behind the API key too (default: open, as /health)")
    access.add_argument("--ssl-keyfile", default=None, metavar="KEY.pem",
                        help="serve HTTPS: the PEM private key (with --ssl-certfile; default: none, plain HTTP)")
    access.add_argument("--ssl-certfile", default=None, metavar="CERT.pem",
                        help="serve HTTPS: the PEM certificate (chain) of the key (default: none, plain HTTP)")
    replicas = p.add_argument_group("replicas", "several copies of the model on Ray Serve (the extra [ray])")
    replicas.add_argument("--replicas", type=positive_int, default=None, metavar="N",
                          help="serve N replicas on Ray Serve, each loading the model (needs the extra [ray]; "
                               "default: none, one model in this process)")
    replicas.add_argument("--ray-address", default=None, metavar="ADDRESS",
                          help="with --replicas: the Ray cluster to join (auto: the one `ray start` runs here); "
                               "default: start a local one")
    replicas.add_argument("--routing", choices=("cache", "random", "least-loaded"), default="cache",
                          help="with --replicas: keep a conversation (X-Session-ID or its prompt's start) on one "
                               "replica unless it is busy (cache), or route at random or to the least loaded")
    tuning = add_runtime_args(p, predictor=predictor)
    tuning.add_argument("--threads", type=threads, default=None,
                        help="torch threads (default: the CPUs this process may use, capped by its cgroup's CPU quota)")
    diagnostics = p.add_argument_group("diagnostics")
    diagnostics.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    return p


def run(args: argparse.Namespace) -> None:
    from offload_runtime.engine.threads import use_decode_threads

    from offload_runtime.server import run_server

    app_args = dict(model_dir=args.model, predictor=args.predictor, options=runtime_options(args),
                    served_model_name=args.served_model_name, max_batch=args.max_batch, max_queue=args.max_queue,
                    shutdown_timeout=args.shutdown_timeout, api_keys=args.api_key or (),
                    metrics_need_key=args.metrics_need_key, prefix_cache_bytes=args.prefix_cache or 0)
    if args.replicas is not None:
        from offload_runtime.server.ray_replicas import run_replicas

        run_replicas(app_args, args.replicas, host=args.host, port=args.port, ray_address=args.ray_address,
                     routing=args.routing, threads=args.threads, ssl_keyfile=args.ssl_keyfile,
                     ssl_certfile=args.ssl_certfile)
        return
    use_decode_threads(args.threads)
    run_server(host=args.host, port=args.port, log_level=args.log_level, ssl_keyfile=args.ssl_keyfile,
               ssl_certfile=args.ssl_certfile, **app_args)
