"""Serving replicas on Ray Serve: `prescient serve --replicas N` (the extra `[ray]`).

Two deployments make the application:

- `replica` (N of them): each holds the whole single-process server of `create_app` (model,
  predictor, runtime options, scheduler, expert cache, metrics labelled with its `replica`),
  loaded once in its constructor, and answers requests the gateway forwards (`Replica.forward`
  runs them through that ASGI app in process, its response streamed back message by message).
- `gateway` (one, no CPU of its own): the ingress behind Ray's HTTP proxy. It reads a request's
  body, keys it (`routing.routing_key`: the session header or the prompt's start) and passes the
  key as the first argument, which Ray's request router for the replicas (`ray_router`) reads to
  keep a conversation on the replica whose cache holds its experts. `GET /health` and `/metrics`
  go to every replica: healthy when all are; one exposition of all the replicas' series.

API keys, request checks, errors, streaming and the OpenAI bodies are the replicas' own (the same
code as `prescient serve`). Ray is imported lazily: without the extra nothing here is imported
until a command asks for replicas, which then stops with one line saying what to install.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from collections.abc import AsyncIterator
from pathlib import Path

from offload_runtime.server.metrics import CONTENT_TYPE, merge_expositions
from offload_runtime.server.routing import MODES, routing_key
from prescient.errors import ServerSettingsError

log = logging.getLogger(__name__)

APP_NAME = "prescient"
REPLICA_HEADER = "x-prescient-replica"  # which replica answered (its Ray replica id)
_EVERY_REPLICA = ("/health", "/metrics")


def require_ray():
    """Ray Serve's module, or a one-line error saying how to install it."""
    try:
        from ray import serve
    except ImportError:
        raise ServerSettingsError('serving replicas needs Ray Serve: pip install -e ".[ray]" '
                                  '(or pip install "ray[serve]==2.60.0")') from None
    return serve


class Replica:
    """One replica: the single-process server over its own runtime, loaded once."""

    def __init__(self, app_args: dict, threads: int | None = None) -> None:
        import torch
        from ray import serve

        from offload_runtime.server.app import create_app

        if threads is not None:
            torch.set_num_threads(threads)
        self.name = serve.get_replica_context().replica_id.unique_id
        self.app = create_app(**app_args, replica=self.name)
        service = self.app.state.service
        service.start()
        if not service.wait_loaded():
            raise service.load_error
        log.info("replica %s loaded", self.name)

    def __del__(self) -> None:  # Ray's graceful shutdown of the replica
        app = getattr(self, "app", None)
        if app is not None:
            app.state.service.close()

    async def forward(self, key: str | None, method: str, path: str, query: bytes,
                      headers: list[tuple[bytes, bytes]], body: bytes) -> AsyncIterator[dict]:
        """Run one request through the app; yields its ASGI response messages (the start, with
        `REPLICA_HEADER` added, then the body's parts). `key` is the router's, unused here. A
        caller that stops reading (its client went away) cancels the request."""
        messages: asyncio.Queue = asyncio.Queue()
        finished = asyncio.Event()
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query,
                 "root_path": "", "headers": headers, "client": None, "server": None}
        pending = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict:
            if pending:
                return pending.pop()
            await finished.wait()
            return {"type": "http.disconnect"}

        task = asyncio.ensure_future(self.app(scope, receive, messages.put))
        task.add_done_callback(lambda _task: messages.put_nowait(None))
        try:
            while (message := await messages.get()) is not None:
                if message["type"] == "http.response.start":
                    message = {**message, "headers": [*message.get("headers", ()),
                                                      (REPLICA_HEADER.encode(), self.name.encode())]}
                yield message
                if message["type"] == "http.response.body" and not message.get("more_body", False):
                    break
        finally:
            finished.set()
            if not task.done():
                await asyncio.wait({task}, timeout=5.0)  # the app sees the disconnect and cancels

    async def get(self, path: str, headers: list[tuple[bytes, bytes]]) -> tuple[int, list, bytes]:
        """A GET through the app, whole: (status, headers, body) (the gateway's /health and /metrics)."""
        status, out_headers, parts = 500, [], []
        async for message in self.forward(None, "GET", path, b"", headers, b""):
            if message["type"] == "http.response.start":
                status, out_headers = message["status"], message.get("headers", [])
            else:
                parts.append(message.get("body", b""))
        return status, out_headers, b"".join(parts)


class Gateway:
    """The ingress: keys each request and hands it to a replica (see the module's docstring)."""

    def __init__(self, replicas) -> None:
        self.replicas = replicas

    async def __call__(self, request):
        from starlette.responses import Response, StreamingResponse

        path = request.url.path
        if request.method == "GET" and path in _EVERY_REPLICA:
            return await self._every_replica(path, request.headers.raw)
        body = await request.body()
        key = routing_key({k.lower(): v for k, v in request.headers.items()}, body)
        stream = self.replicas.options(stream=True).forward.remote(key, request.method, path,
                                                                    request.url.query.encode(),
                                                                    request.headers.raw, body)
        start = await stream.__anext__()
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start.get("headers", ())}
        first = await stream.__anext__()
        if not first.get("more_body", False):  # a whole answer: one body part
            return Response(first.get("body", b""), start["status"], headers=headers)

        async def parts() -> AsyncIterator[bytes]:
            yield first.get("body", b"")
            async for message in stream:
                yield message.get("body", b"")

        headers.pop("content-length", None)
        return StreamingResponse(parts(), start["status"], headers=headers)

    async def _every_replica(self, path: str, headers: list[tuple[bytes, bytes]]):
        from starlette.responses import JSONResponse, Response

        answers = await self.replicas.broadcast("get", path, headers).results_async(timeout_s=30.0)
        for status, out_headers, body in answers:
            if status != 200:  # a replica loading or failed, or a key /metrics needs
                return Response(body, status, headers={k.decode(): v.decode() for k, v in out_headers})
        if path == "/metrics":
            return Response(merge_expositions([body.decode() for _, _, body in answers]), media_type=CONTENT_TYPE)
        return JSONResponse({"status": "ok", "replicas": len(answers)})


def replicas_app(app_args: dict, replicas: int, routing: str = "cache", busy_at: int | None = None,
                 threads: int | None = None):
    """The Ray Serve application: `replicas` replicas of `create_app(**app_args)` behind the
    gateway, routed by `routing` (`routing.MODES`); a replica with `busy_at` requests in flight
    (default: its `max_batch`) is passed over for the least loaded."""
    from offload_runtime.server.app import serve_config

    serve_config(**app_args)  # settings that cannot serve together are refused here, not in each replica
    serve = require_ray()
    from ray.serve.config import RequestRouterConfig

    if routing not in MODES:
        raise ServerSettingsError(f"unknown routing {routing!r}; one of {', '.join(MODES)}")
    max_batch, max_queue = app_args.get("max_batch", 16), app_args.get("max_queue", 64)
    router = RequestRouterConfig(request_router_class="offload_runtime.server.ray_router:CacheAwareRouter",
                                 request_router_kwargs={"mode": routing, "busy_at": busy_at or max_batch})
    replica = serve.deployment(Replica, name="replica", num_replicas=replicas,
                               max_ongoing_requests=max_batch + max_queue,  # the replica's own queue refuses more
                               ray_actor_options={"num_cpus": threads or 1}, request_router_config=router,
                               health_check_period_s=10, graceful_shutdown_timeout_s=30)
    gateway = serve.deployment(Gateway, name="gateway", num_replicas=1, ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=4 * replicas * (max_batch + max_queue))
    return gateway.bind(replica.bind(_absolute(app_args), threads))


def _absolute(app_args: dict) -> dict:
    """The model's and predictor's paths made absolute: replicas do not start in this directory."""
    out = dict(app_args, model_dir=str(Path(app_args["model_dir"]).resolve()))
    predictor = out.get("predictor")
    if isinstance(predictor, (str, os.PathLike)):
        out["predictor"] = str(Path(predictor).resolve())
    return out


def run_replicas(app_args: dict, replicas: int, host: str = "127.0.0.1", port: int = 8000,
                 ray_address: str | None = None, routing: str = "cache", threads: int | None = None,
                 ssl_keyfile: str | None = None, ssl_certfile: str | None = None) -> None:
    """Deploy `replicas_app` on a Ray cluster (a local one started here without `ray_address`;
    "auto" joins the one `ray start` runs on this machine) with Ray's HTTP proxy at host:port, and
    serve until SIGTERM or Ctrl-C; then delete the application (replicas finish in-flight requests
    for 30 s) and leave the cluster."""
    serve = require_ray()
    import ray

    if (ssl_keyfile is None) != (ssl_certfile is None):
        raise ServerSettingsError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
    app = replicas_app(app_args, replicas, routing, threads=threads)
    ray.init(address=ray_address, include_dashboard=False, log_to_driver=True)
    stop = threading.Event()
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        handlers = {sig: signal.signal(sig, lambda _s, _f: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        serve.start(http_options={"host": host, "port": port, "ssl_keyfile": ssl_keyfile,
                                  "ssl_certfile": ssl_certfile})
        serve.run(app, name=APP_NAME, route_prefix="/")
        log.info("serving %d replicas of %s at %s://%s:%d (routing: %s)", replicas, app_args["model_dir"],
                 "https" if ssl_certfile else "http", host, port, routing)
        stop.wait()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        serve.delete(APP_NAME)
        if ray_address is None:
            serve.shutdown()
        ray.shutdown()
