"""The served model: its configuration (`ServeConfig`), and `Service`, which loads the model in the
background and checks each request against it (`ClientError`: the 4xx answer a client caused)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from offload_runtime.engine.memory_plan import Reserves, model_context
from offload_runtime.engine.options import RuntimeOptions
from offload_runtime.server import schemas
from offload_runtime.server.metrics import ServerMetrics
from offload_runtime.server.prefix_cache import PrefixCache
from offload_runtime.server.scheduler import (Event, QueueFullError, Request as Sequence, SamplingParams, Scheduler,
                                              SchedulerClosedError)
from offload_runtime.server.text import TextStream, chat_prompt
from predictor.base import ExpertPredictor
from prescient.errors import CapacityError, PrescientError, ServerSettingsError, UnsupportedModelError

log = logging.getLogger(__name__)

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
    api_keys: tuple[str, ...] = ()  # with any, /v1 routes answer 401 unless one is sent as a bearer token
    metrics_need_key: bool = False  # /metrics behind the keys too (else open, as /health)
    replica: str | None = None  # one of several replicas: its name, a label of every /metrics series
    prefix_cache_bytes: int = 0  # finished sequences' KV kept for prompts that resume them (0: none)

    def __post_init__(self) -> None:
        """A prefix cache is held within a `memory` cap: it must be a byte count below it."""
        size, memory = self.prefix_cache_bytes, self.options.memory
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ServerSettingsError(f"the prefix cache's size must be a whole number of bytes, at least 0; got {size!r}")
        if size and memory is not None and size >= memory:
            raise ServerSettingsError(f"--prefix-cache {_gib(size)} is not below --memory {_gib(memory)}: the "
                                      "prefix cache is held within the memory; give a smaller --prefix-cache or "
                                      "more --memory")

    @property
    def name(self) -> str:
        return self.served_model_name or Path(self.model_dir).name


@dataclass
class ClientError(Exception):
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
        labels = {"policy": config.options.policy, "budget": memory_or_budget(config.options), "predictor": predictor}
        self.metrics = ServerMetrics(labels if config.replica is None else {**labels, "replica": config.replica})
        self.model = self.tokenizer = self.scheduler = None
        self.directory = _open_or_none(config.model_dir)  # None: loading says why
        # the model's context, known before the weights load (/v1/models); 0 where it cannot be read
        self.context_length = (model_context(self.directory.config) or 0) if self.directory is not None else 0
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
        from prescient.model_dir import ModelDirectory

        c = self.config
        try:
            model_dir = self.directory or ModelDirectory.of(c.model_dir)
            tokenizer = model_dir.tokenizer()
            model = _load_within(model_dir, c.predictor, c.options, c.prefix_cache_bytes)
            if model.config.is_encoder_decoder:
                model.close()
                raise UnsupportedModelError(f"{c.model_dir} is an encoder-decoder model; serving decodes "
                                            "decoder-only models (use the Python API for encoder-decoders)")
            eos = model.generation_config.eos_token_id
            eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
            if tokenizer.eos_token_id is not None:
                eos.add(tokenizer.eos_token_id)
            self.model, self.tokenizer = model, tokenizer
            self.scheduler = Scheduler(model, eos, max_batch=c.max_batch, max_queue=c.max_queue,
                                       on_finish=self.metrics.observe_finished,
                                       prefix_cache=PrefixCache(c.prefix_cache_bytes) if c.prefix_cache_bytes else None)
            plan = model.plan
            if plan is not None and plan.resident:  # every expert loaded with the model: no cache policy runs
                self.metrics.labels["policy"] = "none"
            self.metrics.scheduler = self.scheduler
            log.info("serving %s as %r: policy %s, %s, predictor %s, up to %d requests per batch",
                     c.model_dir, c.name, self.metrics.labels["policy"],
                     plan.line() if plan else f"budget {c.options.budget}", c.predictor or "none", c.max_batch)
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
            self.model.close()

    # -- requests ---------------------------------------------------------------------------

    def check(self, body: schemas.CompletionRequest | schemas.ChatRequest) -> None:
        if not self.ready:
            raise ClientError(503, "the model is still loading" if self.load_error is None
                               else f"the model failed to load: {self.load_error}", type="server_error")
        if body.model != self.config.name:
            raise ClientError(404, f"the model {body.model!r} does not exist; this server serves "
                                    f"{self.config.name!r}", param="model", code="model_not_found")
        bad = body.unsupported()
        if bad is not None:
            raise ClientError(400, bad[1], param=bad[0])

    def prompt_ids(self, body: schemas.CompletionRequest | schemas.ChatRequest) -> list[int]:
        if isinstance(body, schemas.ChatRequest):
            text = chat_prompt(self.tokenizer, [{"role": m.role, "content": m.text()} for m in body.messages])
            ids, param = self.tokenizer(text, add_special_tokens=False)["input_ids"], "messages"
        elif isinstance(body.prompt, list) and body.prompt and not isinstance(body.prompt[0], str):
            ids, param = list(body.prompt[0] if isinstance(body.prompt[0], list) else body.prompt), "prompt"
            if ids and (min(ids) < 0 or max(ids) >= len(self.tokenizer)):  # none: refused as empty below
                raise ClientError(400, f"token ids must be in [0, {len(self.tokenizer)})", param="prompt")
        else:
            text = body.prompt if isinstance(body.prompt, str) else "".join(body.prompt)
            ids, param = self.tokenizer(text)["input_ids"], "prompt"
        if not ids:
            raise ClientError(400, "the prompt is empty", param=param)
        if len(ids) >= self.context_length + _scoring_only(body):  # a scored prompt may fill the context
            raise ClientError(400, f"the prompt is {len(ids)} tokens; the model's context is {self.context_length} "
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
        if max_tokens < 1 - _scoring_only(body):
            raise ClientError(400, f"{param} must be at least 1 (0 only with echo), not {max_tokens}", param=param)
        if body.min_tokens > max_tokens:
            raise ClientError(400, f"min_tokens = {body.min_tokens} is more than {param} = {max_tokens}",
                               param="min_tokens")
        if max_tokens > room:
            raise ClientError(400, f"{param} = {max_tokens} goes past the model's context: the prompt takes "
                                    f"{prompt_tokens} of {self.context_length} tokens, {room} are left", param=param,
                               code="context_length_exceeded")
        logprobs = body.logprobs if isinstance(body, schemas.CompletionRequest) else None
        return SamplingParams(max_tokens=max_tokens, temperature=float(body.temperature), top_p=float(body.top_p),
                              seed=body.seed, stop=body.stop_strings(), logprobs=logprobs,
                              prompt_logprobs=logprobs is not None and body.echo, ignore_eos=body.ignore_eos,
                              min_tokens=body.min_tokens)

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
            raise ClientError(429, str(exc), type="rate_limit_error", code="queue_full",
                               headers={"Retry-After": "1"}) from None
        except SchedulerClosedError as exc:
            raise ClientError(503, str(exc), type="server_error") from None
        return sequence, events


def _open_or_none(model_dir: Path):
    """The opened model directory, or None where it cannot be opened (loading then fails with the reason)."""
    from prescient.model_dir import ModelDirectory

    try:
        return ModelDirectory.of(model_dir)
    except (PrescientError, OSError, ValueError, KeyError):
        return None


def _scoring_only(body: schemas.CompletionRequest | schemas.ChatRequest) -> bool:
    """A completion that asks for its prompt back and nothing generated (`echo`, `max_tokens` 0):
    what lm-evaluation-harness's loglikelihood requests amount to."""
    return isinstance(body, schemas.CompletionRequest) and body.echo and body.max_tokens == 0


def _load_within(model_dir, predictor, options: RuntimeOptions, prefix_cache_bytes: int):
    """`load_offloaded` with the prefix cache reserved under a `memory` cap (a `budget` counts
    experts only); a memory too small for the model then says the prefix cache took its share. A
    failing predictor must not stop serving: the runtime goes on with demand loads alone."""
    from offload_runtime.engine.loader import load_offloaded

    serving = replace(options, on_predictor_error="demand")
    try:
        return load_offloaded(model_dir, predictor, serving, reserves=Reserves(prefix_cache=prefix_cache_bytes))
    except CapacityError as exc:
        if options.memory is None or not prefix_cache_bytes:
            raise
        raise CapacityError(f"--memory {_gib(options.memory)} holds the prefix cache's {_gib(prefix_cache_bytes)} "
                            f"beside the model: {exc}; give a smaller --prefix-cache or more --memory") from None


def _gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB ({size} bytes)"


def memory_or_budget(options: RuntimeOptions) -> str:
    """What bounds the experts' memory, as the metrics label it: "memory 8.00GiB" or the budget."""
    return f"memory {options.memory / 2**30:.2f}GiB" if options.memory is not None else str(options.budget)
