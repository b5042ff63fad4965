"""Per-endpoint request handling (as vLLM's `serving_*` modules): a completion or a chat request,
checked by the `Service`, submitted to its scheduler, answered whole or streamed as server-sent
events (`Chunks` writes them); a client that goes away cancels its request. A completion's `echo`
puts the prompt before its text, and `logprobs` the tokens' logprobs in its choice."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from offload_runtime.server import schemas
from offload_runtime.server.logprobs import completion_logprobs
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
        return StreamingResponse(_stream(sequence, events, Chunks(service, body, sequence, rid)),
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
    if chat:
        return JSONResponse(schemas.chat_body(rid, name, text, event.finish_reason, use).model_dump())
    logprobs = None
    if body.logprobs is not None:
        entries, ids = sequence.logprobs, sequence.output_ids
        if body.echo:
            entries, ids = [*sequence.prompt_logprobs, *entries], [*prompt_ids, *ids]
        logprobs = completion_logprobs(service.tokenizer, entries, ids)
    return JSONResponse(schemas.completion_body(rid, name, echo_text(service, body, prompt_ids) + text,
                                                event.finish_reason, use, logprobs).model_dump())


def echo_text(service: Service, body: schemas.CompletionRequest, prompt_ids: list[int]) -> str:
    """What `echo` puts before a completion: the prompt as sent, or its token ids decoded."""
    if not body.echo:
        return ""
    if isinstance(body.prompt, str):
        return body.prompt
    if body.prompt and isinstance(body.prompt[0], str):
        return "".join(body.prompt)
    return service.tokenizer.decode(prompt_ids, skip_special_tokens=True)


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


class Chunks:
    """One streamed answer's server-sent events. `usage` comes on the finish chunk; with
    `stream_options.include_usage` on a chunk of its own with no choices instead, as OpenAI sends
    it; with vLLM's `continuous_usage_stats` too, on every chunk (counting the tokens so far)."""

    def __init__(self, service: Service, body: schemas.CompletionRequest | schemas.ChatRequest,
                 sequence: Sequence, rid: str) -> None:
        self.service, self.body, self.sequence, self.rid = service, body, sequence, rid
        self.chat = isinstance(body, schemas.ChatRequest)
        options = body.stream_options
        self.include_usage = options is not None and bool(options.include_usage)
        self.every_chunk = options is not None and options.per_chunk()
        self.logprobs = None if self.chat else body.logprobs
        self.echo = not self.chat and body.echo  # still to send, before the first token
        self.tokens = 0  # token chunks sent
        self.sent = 0  # characters of text sent: the next streamed token's text offset

    def usage(self) -> schemas.Usage:
        return schemas.usage(len(self.sequence.prompt_ids), self.tokens)

    def text(self, text: str, finish_reason: str | None = None, logprobs: dict | None = None,
             use: schemas.Usage | None = None) -> str:
        name = self.service.config.name
        use = use if use is not None else self.usage() if self.every_chunk else None
        if self.chat:
            first = self.tokens <= 1 and finish_reason is None
            delta = ({"role": "assistant", "content": text} if first else {"content": text}) if text or first else {}
            body = schemas.chat_chunk(self.rid, name, delta, finish_reason, use)
        else:
            body = schemas.completion_body(self.rid, name, text, finish_reason, use, logprobs)
        self.sent += len(text)
        return f"data: {json.dumps(body.model_dump())}\n\n"

    def echoed(self) -> str:
        """The prompt (and its logprobs), the first chunk of a completion with `echo`."""
        self.echo = False
        ids = self.sequence.prompt_ids
        logprobs = None if self.logprobs is None else \
            completion_logprobs(self.service.tokenizer, self.sequence.prompt_logprobs, ids)
        return self.text(echo_text(self.service, self.body, ids), logprobs=logprobs)

    def token(self, event: Event) -> str:
        self.tokens += 1
        logprobs = None if self.logprobs is None else \
            completion_logprobs(self.service.tokenizer, [event.logprob], [event.token_id], self.sent)
        return self.text(event.text, logprobs=logprobs)

    def finish(self, reason: str) -> Iterator[str]:
        """The finish chunk, and the usage chunk where one is asked for."""
        yield self.text("", reason, use=None if self.include_usage else self.usage())
        if self.include_usage:
            name = self.service.config.name
            body = schemas.ChatCompletionChunk(id=self.rid, model=name, choices=[], usage=self.usage()) \
                if self.chat else schemas.Completion(id=self.rid, model=name, choices=[], usage=self.usage())
            yield f"data: {json.dumps(body.model_dump())}\n\n"


async def _stream(sequence: Sequence, events: asyncio.Queue, chunks: Chunks) -> AsyncIterator[str]:
    """Server-sent events: with `echo` the prompt first, one chunk per generated token, then one
    with the finish reason (and the usage), then `[DONE]`. A client that goes away cancels the
    request (the `finally`)."""
    try:
        while True:
            event = await events.get()
            failed = event.finish_reason in ("error", "cancelled")
            if chunks.echo and not failed:  # the prefill is done: the prompt's logprobs are in
                yield chunks.echoed()
            if event.token_id is not None:
                yield chunks.token(event)
            if event.finish_reason is None:
                continue
            if failed:
                message = event.error or "the server shut down before the request finished"
                yield f"data: {json.dumps(schemas.error_body(message, 'server_error'))}\n\n"
            else:
                for chunk in chunks.finish(event.finish_reason):
                    yield chunk
            yield "data: [DONE]\n\n"
            return
    finally:
        if sequence.finish_reason is None:
            sequence.cancel()
