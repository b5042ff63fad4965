"""Per-endpoint request handling (as vLLM's `serving_*` modules): a completion or a chat request,
checked by the `Service`, submitted to its scheduler, answered whole or streamed as server-sent
events; a client that goes away cancels its request."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from offload_runtime.server import schemas
from offload_runtime.server.scheduler import Event, Request as Sequence
from offload_runtime.server.service import Service


async def serve_request(service: Service, body: schemas.CompletionRequest | schemas.ChatRequest, request: Request,
                        chat: bool) -> Response:
    """Answer one /v1/completions (`chat` False) or /v1/chat/completions request."""
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
    return JSONResponse(make(rid, name, text, event.finish_reason, use).model_dump())


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
        return f"data: {json.dumps(body.model_dump())}\n\n"

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
                    body = schemas.ChatCompletionChunk(id=rid, model=name, choices=[], usage=use) if chat else \
                        schemas.Completion(id=rid, model=name, choices=[], usage=use)
                    yield f"data: {json.dumps(body.model_dump())}\n\n"
            yield "data: [DONE]\n\n"
            return
    finally:
        if sequence.finish_reason is None:
            sequence.cancel()
