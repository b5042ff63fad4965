"""An OpenAI-compatible HTTP server over the offloading runtime (FastAPI on uvicorn): the routes.
The served model and its request checks are in `service`, the handling of a completion or chat
request in `handlers`, the typed request and response bodies in `schemas`.

    app = create_app("runs/demo/model", predictor="runs/demo/predictor/sida", policy="mrs", budget=0.5)

returns an ASGI app: mount it, run it with any ASGI server, or call `run_server(...)` (what
`prescient serve` does). The model loads in a background thread when the app starts (its
lifespan); `GET /health` answers 503 until the model and predictor are loaded, 200 after.

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (both with `stream`), `GET
/v1/models`, `GET /health`, `GET /metrics` (Prometheus). With `api_keys`, the /v1 routes (and
/metrics with `metrics_need_key`) answer 401 unless a key comes as a bearer token (`auth`). Errors a
client causes are 4xx with OpenAI's error body; a full queue is 429 with `Retry-After`. A client
that disconnects cancels its request at the next decode step. Shutdown (SIGTERM, Ctrl-C): uvicorn stops accepting, lets
in-flight requests finish for `shutdown_timeout` seconds, cancels the rest; then the inference,
transfer and hash-building threads stop.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import signal
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.authentication import AuthenticationMiddleware

from offload_runtime.engine.options import RuntimeOptions
from offload_runtime.engine.resolve import options_for
from offload_runtime.server import schemas
from offload_runtime.server.auth import APIKeys, unauthorized
from offload_runtime.server.handlers import serve_request
from offload_runtime.server.metrics import CONTENT_TYPE
from offload_runtime.server.service import ClientError, ServeConfig, Service
from predictor.base import ExpertPredictor
from prescient.errors import ServerSettingsError

log = logging.getLogger(__name__)

_UNION_TAG = re.compile(r"str|int|float|bool|\w+\[.*\]|function-\w+\[.*")


def create_app(model_dir: str | Path, predictor: str | Path | ExpertPredictor | None = None,
               options: RuntimeOptions | None = None, **settings) -> FastAPI:
    """The server as an ASGI app; `settings` are the other `ServeConfig` fields and, without
    `options`, `RuntimeOptions`' fields as keywords. The model loads when the app's lifespan
    starts (or call `app.state.service.start()` when mounting the app in one whose lifespan does
    not reach it)."""
    service = Service(serve_config(model_dir, predictor, options, **settings))

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        service.start()
        yield
        await asyncio.to_thread(service.close)

    app = FastAPI(title="moe-prescient", lifespan=lifespan)
    app.state.service = service
    if service.config.api_keys:
        guarded = ("/v1", "/metrics") if service.config.metrics_need_key else ("/v1",)
        app.add_middleware(AuthenticationMiddleware, backend=APIKeys(service.config.api_keys, guarded),
                           on_error=unauthorized)

    for error, handler in ((ClientError, _client_error), (RequestValidationError, _invalid),
                           (Exception, _server_error), (StarletteHTTPException, _http_error)):
        app.add_exception_handler(error, handler)
    _add_routes(app, service)
    return app


async def _client_error(_request: Request, exc: ClientError) -> JSONResponse:
    return JSONResponse(schemas.error_body(exc.message, exc.type, exc.param, exc.code), exc.status,
                        headers=exc.headers)


async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0]
    # the field's path, without "body" and the union-member tags pydantic adds ("float", "list[str]")
    where = [str(part) for part in first.get("loc", ())
             if part != "body" and not _UNION_TAG.fullmatch(str(part))]
    message = first.get("msg", "invalid request")
    if first.get("type") == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {where[-1]}"
    elif first.get("type") == "json_invalid":  # loc holds the character offset
        message, where = f"the body is not valid JSON: {first.get('ctx', {}).get('error', message)}", []
    elif where:
        message = f"{'.'.join(where)}: {message}"
    return JSONResponse(schemas.error_body(message, param=".".join(where) or None), 400)


async def _server_error(_request: Request, exc: Exception) -> JSONResponse:  # a bug of ours: logged, still OpenAI's body
    return JSONResponse(schemas.error_body(f"internal error: {type(exc).__name__}", "server_error"), 500)


async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return JSONResponse(schemas.error_body(str(exc.detail)), exc.status_code, headers=exc.headers)


def _add_routes(app: FastAPI, service: Service) -> None:
    """Health, metrics, the model list and the two OpenAI routes, answered by `service`."""
    @app.get("/health")
    async def health() -> JSONResponse:
        if service.ready:
            return JSONResponse({"status": "ok"})
        if service.load_error is not None:
            return JSONResponse({"status": "failed", "error": str(service.load_error)}, 503)
        return JSONResponse({"status": "loading"}, 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> schemas.ModelList:
        return schemas.ModelList(data=[schemas.ModelCard(id=service.config.name,
                                                         max_model_len=service.context_length)])

    @app.post("/v1/completions")
    async def completions(body: schemas.CompletionRequest, request: Request) -> Response:
        return await serve_request(service, body, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: schemas.ChatRequest, request: Request) -> Response:
        return await serve_request(service, body, request, chat=True)


def serve_config(model_dir: str | Path, predictor: str | Path | ExpertPredictor | None = None,
                 options: RuntimeOptions | None = None, **settings) -> ServeConfig:
    """The `ServeConfig` of `create_app`'s arguments, checked (ServerSettingsError where they cannot
    serve together)."""
    runtime = {name: settings.pop(name) for name in RuntimeOptions.names() & settings.keys()}
    return ServeConfig(Path(model_dir), predictor, options_for(model_dir, predictor, options, runtime), **settings)


def run_server(host: str = "127.0.0.1", port: int = 8000, log_level: str = "info", ssl_keyfile: str | None = None,
               ssl_certfile: str | None = None, **app_args) -> None:
    """Serve `create_app(**app_args)` with uvicorn (over HTTPS with `ssl_keyfile` and `ssl_certfile`)
    until SIGTERM or Ctrl-C, then shut down gracefully and return (exit status 0). A model that
    cannot load stops the server and its error is raised here."""
    import uvicorn

    if (ssl_keyfile is None) != (ssl_certfile is None):
        raise ServerSettingsError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
    app = create_app(**app_args)
    service: Service = app.state.service
    if service.config.metrics_need_key and not service.config.api_keys:
        raise ServerSettingsError("/metrics can need a key only when there is one: give --api-key (or its "
                                  "environment variable) with --metrics-need-key")
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=service.config.shutdown_timeout, ssl_keyfile=ssl_keyfile,
                            ssl_certfile=ssl_certfile)
    try:
        config.load()  # reads the certificate and key now: a bad one is one error, not a traceback in uvicorn
    except OSError as exc:  # ssl.SSLError included
        raise ServerSettingsError(f"cannot use the TLS key {ssl_keyfile} with the certificate {ssl_certfile}: "
                                  f"{exc.strerror or exc}; give a PEM key and the PEM certificate that matches it"
                                  ) from None
    if not service.config.api_keys and not _loopback(host):
        log.warning("serving on %s with no API key: anyone who reaches port %d can use the model; give "
                    "`prescient serve` --api-key (or its environment variable)", host, port)
    server = uvicorn.Server(config)
    service.on_load_error = lambda _exc: setattr(server, "should_exit", True)
    # uvicorn re-raises the signal that stopped it once it is done, under the handler it found:
    # with these, a graceful stop ends in a normal return instead of death by that signal
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        handlers = {sig: signal.signal(sig, lambda s, _f: log.info("stopped by signal %d", s))
                    for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    if service.load_error is not None:
        raise service.load_error


def _loopback(host: str) -> bool:
    """Whether `host` binds this machine's loopback interface only."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name
        return host == "localhost"
