"""An OpenAI-compatible HTTP server over the offloading runtime (FastAPI on uvicorn).

    app = create_app("runs/bench-model", predictor="runs/demo/predictor/sida", policy="mrs", budget=0.5)

returns an ASGI app: mount it, run it with any ASGI server, or call `run_server(...)` (what
`prescient serve` does). The model loads in a background thread when the app starts (its
lifespan); `GET /health` answers 503 until the model and predictor are loaded, 200 after.

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (both with `stream`), `GET
/v1/models`, `GET /health`, `GET /metrics` (Prometheus). Errors a client causes are 4xx with
OpenAI's error body; a full queue is 429 with `Retry-After`. A client that disconnects cancels
its request at the next decode step. Shutdown (SIGTERM, Ctrl-C): uvicorn stops accepting, lets
in-flight requests finish for `shutdown_timeout` seconds, cancels the rest; then the inference,
transfer and hash-building threads stop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import signal
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from offload_runtime.server import schemas
from offload_runtime.server.metrics import CONTENT_TYPE, ServerMetrics
from offload_runtime.server.scheduler import (Event, QueueFullError, Request as Sequence, SamplingParams, Scheduler,
                                              SchedulerClosedError)
from offload_runtime.server.text import TextStream, chat_prompt
from offload_runtime.engine.options import RuntimeOptions
from predictor.base import ExpertPredictor
from prescient.errors import UnsupportedModelError

log = logging.getLogger(__name__)

_UNION_TAG = re.compile(r"str|int|float|bool|\w+\[.*\]|function-\w+\[.*")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the context left


@dataclass
class ServeConfig:
    model_dir: Path
    predictor: str | Path | ExpertPredictor | None = None  # an artifact path, or a predictor
    options: RuntimeOptions = field(default_factory=RuntimeOptions)  # the runtime's (see load_offloaded)
    served_model_name: str | None = None  # the `model` clients name; default: the model directory's name
    max_batch: int = 16  # requests decoded together
    max_queue: int = 64  # requests waiting beyond the batch; more are refused with 429
    shutdown_timeout: float = 30.0  # seconds in-flight requests get to finish at shutdown

    @property
    def name(self) -> str:
        return self.served_model_name or Path(self.model_dir).name


@dataclass
class _ClientError(Exception):
    status: int
    message: str
    param: str | None = None
    code: str | None = None
    type: str = "invalid_request_error"
    headers: dict[str, str] = field(default_factory=dict)


class Service:
    """The loaded model, its scheduler and metrics; what the HTTP routes call."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        predictor = "none" if config.predictor is None else getattr(config.predictor, "kind", None) \
            or Path(str(config.predictor)).name.removesuffix(".json").removesuffix(".safetensors")
        self.metrics = ServerMetrics({"policy": config.options.policy, "budget": str(config.options.budget),
                                      "predictor": predictor})
        self.model = self.tokenizer = self.scheduler = None
        self.context_length = 0
        self.load_error: BaseException | None = None
        self.on_load_error: Callable[[BaseException], None] | None = None
        self._loader: threading.Thread | None = None

    @property
    def ready(self) -> bool:
        return self.scheduler is not None

    def start(self) -> None:
        """Load in the background (idempotent)."""
        if self._loader is None:
            self._loader = threading.Thread(target=self._load, name="serve-loader", daemon=True)
            self._loader.start()

    def wait_loaded(self, timeout: float | None = None) -> bool:
        if self._loader is not None:
            self._loader.join(timeout)
        return self.ready

    def _load(self) -> None:
        from offload_runtime.engine.loader import load_offloaded
        from prescient.loading import load_tokenizer

        c = self.config
        try:
            tokenizer = load_tokenizer(c.model_dir)
            model = load_offloaded(c.model_dir, c.predictor, c.options)
            if model.config.is_encoder_decoder:
                model.offload_runtime.close()
                raise UnsupportedModelError(f"{c.model_dir} is an encoder-decoder model; serving decodes "
                                            "decoder-only models (use the Python API for encoder-decoders)")
            model.offload_runtime.on_predictor_error = "demand"  # a failing predictor must not stop serving
            eos = model.generation_config.eos_token_id
            eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
            if tokenizer.eos_token_id is not None:
                eos.add(tokenizer.eos_token_id)
            self.model, self.tokenizer = model, tokenizer
            self.context_length = model.config.max_position_embeddings
            self.scheduler = Scheduler(model, eos, max_batch=c.max_batch, max_queue=c.max_queue,
                                       on_finish=self.metrics.observe_finished)
            self.metrics.scheduler = self.scheduler
            log.info("serving %s as %r: policy %s, budget %s, predictor %s, up to %d requests per batch",
                     c.model_dir, c.name, c.options.policy, c.options.budget, c.predictor or "none", c.max_batch)
        except BaseException as exc:
            self.load_error = exc
            log.error("cannot serve %s: %s", c.model_dir, exc)
            if self.on_load_error is not None:
                self.on_load_error(exc)

    def close(self) -> None:
        """Stop the scheduler (cancelling what is left) and the runtime's threads."""
        if self._loader is not None:
            self._loader.join()
        if self.scheduler is not None:
            self.scheduler.close()
        if self.model is not None:
            self.model.offload_runtime.close()

    # -- requests ---------------------------------------------------------------------------

    def check(self, body: schemas.CompletionRequest | schemas.ChatRequest) -> None:
        if not self.ready:
            raise _ClientError(503, "the model is still loading" if self.load_error is None
                               else f"the model failed to load: {self.load_error}", type="server_error")
        if body.model != self.config.name:
            raise _ClientError(404, f"the model {body.model!r} does not exist; this server serves "
                                    f"{self.config.name!r}", param="model", code="model_not_found")
        bad = body.unsupported()
        if bad is not None:
            raise _ClientError(400, bad[1], param=bad[0])

    def prompt_ids(self, body: schemas.CompletionRequest | schemas.ChatRequest) -> list[int]:
        if isinstance(body, schemas.ChatRequest):
            text = chat_prompt(self.tokenizer, [{"role": m.role, "content": m.text()} for m in body.messages])
            ids, param = self.tokenizer(text, add_special_tokens=False)["input_ids"], "messages"
        elif isinstance(body.prompt, list) and all(isinstance(t, int) for t in body.prompt) and body.prompt:
            ids, param = list(body.prompt), "prompt"
            if min(ids) < 0 or max(ids) >= len(self.tokenizer):
                raise _ClientError(400, f"token ids must be in [0, {len(self.tokenizer)})", param="prompt")
        else:
            text = body.prompt if isinstance(body.prompt, str) else "".join(body.prompt)
            ids, param = self.tokenizer(text)["input_ids"], "prompt"
        if not ids:
            raise _ClientError(400, "the prompt is empty", param=param)
        if len(ids) >= self.context_length:
            raise _ClientError(400, f"the prompt is {len(ids)} tokens; the model's context is {self.context_length} "
                                    "tokens, and at least one must be left to generate", param=param,
                               code="context_length_exceeded")
        return ids

    def params(self, body: schemas.CompletionRequest | schemas.ChatRequest, prompt_tokens: int) -> SamplingParams:
        room = self.context_length - prompt_tokens
        if isinstance(body, schemas.ChatRequest):
            asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
            param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
            max_tokens = asked if asked is not None else room
        else:
            asked, param = body.max_tokens, "max_tokens"
            max_tokens = asked if asked is not None else min(COMPLETIONS_DEFAULT_MAX_TOKENS, room)
        if max_tokens < 1:
            raise _ClientError(400, f"{param} must be at least 1, not {max_tokens}", param=param)
        if max_tokens > room:
            raise _ClientError(400, f"{param} = {max_tokens} goes past the model's context: the prompt takes "
                                    f"{prompt_tokens} of {self.context_length} tokens, {room} are left", param=param,
                               code="context_length_exceeded")
        return SamplingParams(max_tokens=max_tokens, temperature=float(body.temperature), top_p=float(body.top_p),
                              seed=body.seed, stop=body.stop_strings())

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> tuple[Sequence, asyncio.Queue]:
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def on_event(event: Event) -> None:  # the inference thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the event loop is gone (shutdown)
                pass

        sequence = Sequence(prompt_ids, params, on_event, TextStream(self.tokenizer, params.stop))
        try:
            self.scheduler.submit(sequence)
        except QueueFullError as exc:
            raise _ClientError(429, str(exc), type="rate_limit_error", code="queue_full",
                               headers={"Retry-After": "1"}) from None
        except SchedulerClosedError as exc:
            raise _ClientError(503, str(exc), type="server_error") from None
        return sequence, events


def create_app(model_dir: str | Path, predictor: str | Path | ExpertPredictor | None = None,
               options: RuntimeOptions | None = None, **settings) -> FastAPI:
    """The server as an ASGI app; `settings` are the other `ServeConfig` fields and, without
    `options`, `RuntimeOptions`' fields as keywords. The model loads when the app's lifespan
    starts (or call `app.state.service.start()` when mounting the app in one whose lifespan does
    not reach it)."""
    runtime = {name: settings.pop(name) for name in RuntimeOptions.names() & settings.keys()}
    options = RuntimeOptions.of(options, **runtime)
    service = Service(ServeConfig(Path(model_dir), predictor, options, **settings))

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        service.start()
        yield
        await asyncio.to_thread(service.close)

    app = FastAPI(title="moe-prescient", lifespan=lifespan)
    app.state.service = service

    @app.exception_handler(_ClientError)
    async def client_error(_request: Request, exc: _ClientError) -> JSONResponse:
        return JSONResponse(schemas.error_body(exc.message, exc.type, exc.param, exc.code), exc.status,
                            headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
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

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(schemas.error_body(str(exc.detail)), exc.status_code, headers=exc.headers)

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
    async def models() -> dict:
        return {"object": "list", "data": [{"id": service.config.name, "object": "model", "created": 0,
                                            "owned_by": "moe-prescient", "max_model_len": service.context_length}]}

    @app.post("/v1/completions")
    async def completions(body: schemas.CompletionRequest, request: Request) -> Response:
        return await _serve(service, body, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: schemas.ChatRequest, request: Request) -> Response:
        return await _serve(service, body, request, chat=True)

    return app


async def _serve(service: Service, body, request: Request, chat: bool) -> Response:
    service.check(body)
    prompt_ids = service.prompt_ids(body)
    sequence, events = service.submit(prompt_ids, service.params(body, len(prompt_ids)))
    rid, name = schemas.new_id("chatcmpl" if chat else "cmpl"), service.config.name
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(_stream(sequence, events, rid, name, chat, include_usage),
                                 media_type="text/event-stream")
    final = asyncio.ensure_future(_final(events))
    gone = asyncio.ensure_future(_disconnected(request))
    await asyncio.wait({final, gone}, return_when=asyncio.FIRST_COMPLETED)
    if not final.done():  # the client went away: free its place in the batch
        sequence.cancel()
        final.cancel()
        return Response(status_code=499)
    gone.cancel()
    text, event = final.result()
    if event.finish_reason in ("error", "cancelled"):
        message = event.error or "the server shut down before the request finished"
        return JSONResponse(schemas.error_body(message, "server_error"), 500 if event.error else 503)
    use = schemas.usage(len(prompt_ids), len(sequence.output_ids))
    make = schemas.chat_body if chat else schemas.completion_body
    return JSONResponse(make(rid, name, text, event.finish_reason, use))


async def _final(events: asyncio.Queue) -> tuple[str, Event]:
    parts = []
    while True:
        event = await events.get()
        parts.append(event.text)
        if event.finish_reason is not None:
            return "".join(parts), event


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _stream(sequence: Sequence, events: asyncio.Queue, rid: str, name: str, chat: bool,
                  include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: one chunk per generated token, then one with the finish reason and the
    usage, then `[DONE]`. A client that goes away cancels the request (the `finally`)."""
    def chunk(text: str, finish_reason: str | None = None, use: dict | None = None, first: bool = False) -> str:
        if chat:
            delta = ({"role": "assistant", "content": text} if first else {"content": text}) if text or first else {}
            body = schemas.chat_chunk(rid, name, delta, finish_reason, use)
        else:
            body = schemas.completion_body(rid, name, text, finish_reason, use)
        return f"data: {json.dumps(body)}\n\n"

    first = True
    try:
        while True:
            event = await events.get()
            if event.token_id is not None:
                yield chunk(event.text, first=first)
                first = False
            if event.finish_reason is None:
                continue
            if event.finish_reason in ("error", "cancelled"):
                message = event.error or "the server shut down before the request finished"
                yield f"data: {json.dumps(schemas.error_body(message, 'server_error'))}\n\n"
            else:
                use = schemas.usage(len(sequence.prompt_ids), len(sequence.output_ids))
                # usage: on the finish chunk, or, as OpenAI does with include_usage, on a chunk of its own
                yield chunk("", event.finish_reason, None if include_usage else use)
                if include_usage:
                    body = {**schemas.chat_chunk(rid, name, {}, None, use), "choices": []} if chat else \
                        {**schemas.completion_body(rid, name, "", None, use), "choices": []}
                    yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"
            return
    finally:
        if sequence.finish_reason is None:
            sequence.cancel()


def run_server(host: str = "127.0.0.1", port: int = 8000, log_level: str = "info", **app_args) -> None:
    """Serve `create_app(**app_args)` with uvicorn until SIGTERM or Ctrl-C, then shut down
    gracefully and return (exit status 0). A model that cannot load stops the server and its
    error is raised here."""
    import uvicorn

    app = create_app(**app_args)
    service: Service = app.state.service
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                                           timeout_graceful_shutdown=service.config.shutdown_timeout))
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
