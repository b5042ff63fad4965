"""The OpenAI request bodies this server reads, and the response bodies it writes (typed
pydantic models, as vLLM's `protocol.py`; `model_dump()` gives the JSON).

Requests are strict: a field of the wrong type and a field the OpenAI API does not have are 400
errors (as OpenAI itself answers "Unrecognized request argument"); OpenAI fields this server
does not implement are accepted only at their no-op values (`n` = 1, no logprobs on chat, zero
penalties, ...), anything else is a 400 naming the field. vLLM's extensions that mean something
here are accepted too: `ignore_eos`, `min_tokens`, `stream_options.continuous_usage_stats`.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from offload_runtime.server.logprobs import MAX_LOGPROBS


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool | None = False
    continuous_usage_stats: StrictBool | None = False  # vLLM's: with include_usage, usage on every chunk

    def per_chunk(self) -> bool:
        return bool(self.include_usage and self.continuous_usage_stats)


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | StrictInt = Field(1.0, ge=0.0, le=2.0)
    top_p: StrictFloat | StrictInt = Field(1.0, gt=0.0, le=1.0)
    seed: StrictInt | None = Field(None, ge=-2**63, lt=2**64)  # what torch's generator takes
    stop: StrictStr | list[StrictStr] | None = None  # any number, as vLLM (OpenAI: 4; lm-eval adds end-of-text to a task's own)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    ignore_eos: StrictBool = False  # vLLM's: the end-of-text token does not end the answer
    min_tokens: StrictInt = Field(0, ge=0)  # vLLM's: tokens before end-of-text or a stop string may end it
    # OpenAI fields accepted only at their no-op values (see `unsupported`)
    n: StrictInt = 1
    presence_penalty: StrictFloat | StrictInt = 0.0
    frequency_penalty: StrictFloat | StrictInt = 0.0
    logit_bias: dict[str, StrictFloat | StrictInt] | None = None

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def unsupported(self) -> tuple[str, str] | None:
        """(field, message) for the first field set to a value this server cannot honour."""
        if self.n != 1:
            return "n", "only n = 1 is supported (one choice per request); send several requests instead"
        if self.presence_penalty or self.frequency_penalty:
            field = "presence_penalty" if self.presence_penalty else "frequency_penalty"
            return field, f"{field} is not supported; leave it at 0"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        return None


class CompletionRequest(_Common):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]  # the last: lm-eval's
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)  # top-N logprobs per token
    echo: StrictBool = False  # the prompt (and its tokens' logprobs) before the completion
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str | list) \
                and len(self.prompt) != 1:
            return "prompt", "one prompt per request (a list of several prompts is not supported)"
        if self.best_of not in (None, 1):
            return "best_of", "only best_of = 1 is supported"
        if self.suffix:
            return "suffix", "suffix is not supported"
        return super().unsupported()


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart]
    name: StrictStr | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.logprobs:
            return "logprobs", "logprobs are not supported on chat completions; /v1/completions has them"
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            return "max_completion_tokens", "give max_tokens or max_completion_tokens, not both"
        return super().unsupported()


# -- responses ------------------------------------------------------------------------------

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """The legacy completions API's `logprobs` object: per token, in order."""

    tokens: list[str]
    token_logprobs: list[float | None]  # None for the prompt's first token (echo)
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]  # each token's first character in the choice's text


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class _Answer(BaseModel):
    """What every answer and stream chunk holds; each kind names its `object` and its choices."""

    id: str
    object: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list
    usage: Usage | None = None


class Completion(_Answer):
    """A /v1/completions answer, or one of its stream chunks (OpenAI's `text_completion`)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None


class ChatCompletion(_Answer):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class ChunkChoice(BaseModel):
    index: int = 0
    delta: dict[str, str]  # {"role", "content"} first, {"content"} after, {} on the finish chunk
    logprobs: None = None
    finish_reason: str | None


class ChatCompletionChunk(_Answer):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChunkChoice]


class ErrorDetail(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "moe-prescient"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens)


def completion_body(rid: str, model: str, text: str, finish_reason: str | None, use: Usage | None,
                    logprobs: dict | None = None) -> Completion:
    choice = CompletionChoice(text=text, finish_reason=finish_reason,
                              logprobs=None if logprobs is None else CompletionLogprobs(**logprobs))
    return Completion(id=rid, model=model, choices=[choice], usage=use)


def chat_body(rid: str, model: str, text: str, finish_reason: str | None, use: Usage | None) -> ChatCompletion:
    return ChatCompletion(id=rid, model=model, usage=use,
                          choices=[ChatChoice(message=AssistantMessage(content=text), finish_reason=finish_reason)])


def chat_chunk(rid: str, model: str, delta: dict[str, str], finish_reason: str | None,
               use: Usage | None) -> ChatCompletionChunk:
    return ChatCompletionChunk(id=rid, model=model, choices=[ChunkChoice(delta=delta, finish_reason=finish_reason)],
                               usage=use)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error body, as JSON-ready data."""
    return ErrorResponse(error=ErrorDetail(message=message, type=type_, param=param, code=code)).model_dump()
