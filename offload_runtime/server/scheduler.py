"""Dynamic batching: one inference thread decodes every running request together.

Requests wait in a bounded queue (`submit` raises `QueueFullError` beyond it: the HTTP layer
answers 429). Each turn of the inference thread
  1. drops the requests whose client went away (`Request.cancel`), at once, from the queue and
     from the running batch;
  2. prefills the requests that arrived, up to `max_batch` running, together in one forward
     (left-padded), samples each one's first token and merges their KV caches into the batch;
  3. runs one decode forward over every running request: one new token per row, each row at its
     own position with its padding masked, so a request's tokens are those it would get alone;
  4. samples each row with its own settings and generator, streams the token out (with its
     logprobs when the request asks), and retires the rows that finished (end of text,
     `max_tokens`, a stop string).

With a prefix cache (`prefix_cache`), a finished request leaves its KV there and a request whose
prompt starts with a cached sequence's tokens prefills only the rest of it.

A request with `prompt_logprobs` gets its prompt's own logprobs from its prefill (that forward
then keeps every position's logits, so it never resumes a cached prefix); one with `max_tokens` 0 ends after its prefill, unsampled.

The offloaded model's expert cache then serves all running requests at once: an expert loaded
for one row's token is used by every row that routes to it in that step. The runtime is told
which request each row belongs to, so the predictor keeps one state per request.

Only this thread runs the model (the runtime's inference thread). A failing forward fails the
requests in it, and serving goes on.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import DynamicCache

from offload_runtime.engine.model_runtime import ModelRuntime
from offload_runtime.server.kv_batch import KVBatch, prefill_inputs
from offload_runtime.server.logprobs import TokenLogprob, prompt_logprobs, token_logprob
from offload_runtime.server.prefix_cache import Prefix, PrefixCache
from offload_runtime.server.text import TextStream
from prescient.errors import PrescientError

log = logging.getLogger(__name__)


class QueueFullError(PrescientError):
    """The request queue is full; the client should retry later."""


class SchedulerClosedError(PrescientError):
    """The server is shutting down and takes no new requests."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # top-N logprobs of each generated token (None: none)
    prompt_logprobs: bool = False  # the prompt tokens' own logprobs too (top `logprobs` of each)
    ignore_eos: bool = False  # the end-of-text token does not end the request
    min_tokens: int = 0  # tokens generated before end-of-text or a stop string may end it


@dataclass
class Event:
    """One step of a request's output, handed to its `on_event` from the inference thread."""

    text: str  # new text (may be empty: held back, or a token without text)
    token_id: int | None  # None on the final event of a request that ended without a new token
    finish_reason: str | None = None  # "stop", "length", "cancelled", "error"; None while running
    error: str | None = None
    logprob: TokenLogprob | None = None  # the token's, when the request asks for logprobs


@dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    on_event: Callable[[Event], None]
    stream: TextStream
    id: int = field(default_factory=itertools.count().__next__)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per output token, with params.logprobs
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token, set by the prefill
    arrived: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None
    cancelled: bool = False
    generator: torch.Generator = field(default_factory=torch.Generator)

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.generator.manual_seed(self.params.seed)
        else:
            self.generator.seed()

    def cancel(self) -> None:
        """The client went away: the inference thread drops the request at its next turn."""
        self.cancelled = True


@dataclass
class SchedulerCounters:
    """Totals since start; read by /metrics (plain ints, written by the inference thread only)."""

    finished: dict[str, int] = field(default_factory=dict)  # per finish reason
    rejected: int = 0
    prompt_tokens: int = 0
    prompt_tokens_cached: int = 0  # of prompt_tokens, those whose KV came from the prefix cache
    completion_tokens: int = 0
    prefill_forwards: int = 0
    prefill_expert_hits: int = 0  # of the runtime's expert-cache hits and misses, those of prefills
    prefill_expert_misses: int = 0
    decode_steps: int = 0
    decode_rows: int = 0  # summed batch size over decode steps


class Scheduler:
    def __init__(self, model, eos_token_ids: set[int], max_batch: int = 16, max_queue: int = 64,
                 on_finish: Callable[[Request], None] | None = None,
                 prefix_cache: PrefixCache | None = None) -> None:
        self.model, self.eos_token_ids = model, eos_token_ids
        self.prefix_cache = prefix_cache
        self.runtime: ModelRuntime | None = getattr(model, "runtime", None)
        self.max_batch, self.max_queue = max_batch, max_queue
        self.on_finish = on_finish
        self.counters = SchedulerCounters()
        self.stats = self.runtime.stats() if self.runtime is not None else None  # snapshot after each forward
        self.pad_token_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._batch: KVBatch | None = None
        self._next: list[int] = []  # per running row, the token its next decode step reads
        self._wake = threading.Condition()
        self._closing = False
        self._started = time.perf_counter()
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) per sampling step, last minute
        self._recent_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="serve-inference", daemon=True)
        self._thread.start()

    # -- any thread --------------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        with self._wake:
            if self._closing:
                raise SchedulerClosedError("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                self.counters.rejected += 1
                raise QueueFullError(f"{len(self._waiting)} requests are already waiting (the queue holds "
                                     f"{self.max_queue}); retry later")
            self._waiting.append(request)
            self._wake.notify()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    def tokens_per_second(self, window: float = 10.0) -> float:
        """Tokens generated per second over the last `window` seconds (or since start)."""
        now = time.perf_counter()
        with self._recent_lock:
            tokens = sum(n for t, n in self._recent if t >= now - window)
        return tokens / min(window, max(now - self._started, 1e-9))

    def close(self, timeout: float = 30.0) -> None:
        """Cancel what is queued and running, stop the thread (it finishes its current forward)."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("the inference thread is still in a forward after %.0f s; leaving it", timeout)

    # -- the inference thread ----------------------------------------------------------------

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._wake:
                    while not self._closing and not self._waiting and not self._running:
                        self._wake.wait()
                    if self._closing:
                        break
                    room = self.max_batch - len(self._running)
                    arrived = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
                for request in arrived:
                    if request.cancelled:
                        self._finish(request, "cancelled")
                arrived = [r for r in arrived if not r.cancelled]
                self._retire([r for r in self._running if r.cancelled])
                try:
                    if arrived:
                        self._prefill(arrived)
                    if self._running:
                        self._decode()
                except Exception as exc:  # a failed forward fails its requests, not the server
                    log.exception("forward failed; failing %d requests", len(self._running) + len(arrived))
                    failed = [*self._running, *arrived]
                    for request in failed:
                        if request.finish_reason is None:
                            self._finish(request, "error", error=f"{type(exc).__name__}: {exc}")
                    self._running, self._batch, self._next = [], None, []
                    if self.runtime is not None:
                        self.runtime.end_sequences([r.id for r in failed])
        with self._wake:
            left = [*self._waiting, *self._running]
            self._waiting.clear()
        for request in left:
            self._finish(request, "cancelled")
        self._running, self._batch = [], None

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: DynamicCache,
                 requests: list[Request], every_position: bool = False) -> torch.Tensor:
        """The logits of one forward over `requests`' rows, on the model's device: [B, T, V] with
        `every_position`, else the last position's only ([B, 1, V])."""
        device = self.model.device
        with self.runtime.rows([r.id for r in requests]) if self.runtime is not None else nullcontext():
            out = self.model(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=positions.to(device),
                             cache=cache, use_cache=True, logits_to_keep=0 if every_position else 1)
        if self.runtime is not None:
            self.stats = self.runtime.stats()
        return out.logits

    def _prefill(self, requests: list[Request]) -> None:
        pasts = [self._cached_prefix(r) for r in requests]
        new = [r.prompt_ids[len(past.tokens) if past else 0:] for r, past in zip(requests, pasts)]
        ids, valid, positions, cache = prefill_inputs(new, pasts, self.pad_token_id, self.model.config)
        length = ids.shape[1]
        scored = [row for row, r in enumerate(requests) if r.params.prompt_logprobs]
        before = self.stats
        logits = self._forward(ids, valid.long(), positions, cache, requests, every_position=bool(scored))
        if before is not None:
            self.counters.prefill_expert_hits += self.stats.hits - before.hits
            self.counters.prefill_expert_misses += self.stats.misses - before.misses
        for row in scored:  # the prompt's own logprobs: its positions but the last predict its tokens after the first
            request = requests[row]
            request.prompt_logprobs = prompt_logprobs(logits[row, length - len(request.prompt_ids):-1],
                                                      request.prompt_ids, request.params.logprobs or 0)
        self.counters.prefill_forwards += 1
        self.counters.prompt_tokens += sum(len(r.prompt_ids) for r in requests)
        self.counters.prompt_tokens_cached += sum(len(past.tokens) for past in pasts if past is not None)
        batch = KVBatch(cache, valid)
        if self._batch is None:
            self._batch = batch
        else:
            self._batch.merge(batch)
        self._running += requests
        self._next += [0] * len(requests)
        self._emit(logits[:, -1].float().cpu(), first_row=len(self._running) - len(requests))

    def _cached_prefix(self, request: Request) -> Prefix | None:
        if self.prefix_cache is None or request.params.prompt_logprobs:  # those need every prompt position
            return None
        return self.prefix_cache.lookup(request.prompt_ids)

    def _decode(self) -> None:
        mask, positions = self._batch.decode_inputs()
        ids = torch.tensor(self._next, dtype=torch.long)[:, None]
        logits = self._forward(ids, mask, positions, self._batch.cache, self._running)
        self._batch.appended()
        self.counters.decode_steps += 1
        self.counters.decode_rows += len(self._running)
        self._emit(logits[:, -1].float().cpu(), first_row=0)

    def _emit(self, logits: torch.Tensor, first_row: int) -> None:
        """Sample rows first_row.. of the running batch from `logits` (one row each), hand out
        their tokens, and retire the finished ones."""
        done, sampled = [], 0
        now = time.perf_counter()
        for offset, row_logits in enumerate(logits):
            row = first_row + offset
            request = self._running[row]
            if request.params.max_tokens == 0:  # prompt scoring only: the prefill was all it asked for
                done.append(request)
                self._finish(request, "length")
                continue
            token, reason = self._step(request, row_logits, now)
            self._next[row] = token
            sampled += 1
            if reason is not None:
                done.append(request)
        self._retire(done, finished=True)
        with self._recent_lock:
            self._recent.append((now, sampled))
            while self._recent and self._recent[0][0] < now - 60:
                self._recent.popleft()

    def _step(self, request: Request, logits: torch.Tensor, now: float) -> tuple[int, str | None]:
        """Sample `request`'s next token from its row's `logits` ([V]) and hand it out; the token
        and the finish reason (None while the request goes on)."""
        params = request.params
        shaped = logits
        if len(request.output_ids) < params.min_tokens and self.eos_token_ids:  # end-of-text cannot come yet
            shaped = logits.clone()
            shaped[list(self.eos_token_ids)] = float("-inf")
        token = sample(shaped, params, request.generator)
        logprob = token_logprob(logits, token, params.logprobs) if params.logprobs is not None else None
        request.output_ids.append(token)
        if logprob is not None:
            request.logprobs.append(logprob)
        if request.first_token_at is None:
            request.first_token_at = now
        self.counters.completion_tokens += 1
        text = request.stream.add(token, stops=len(request.output_ids) >= params.min_tokens)  # as vLLM counts
        if (token in self.eos_token_ids and not params.ignore_eos) or request.stream.stopped:
            reason = "stop"
        elif len(request.output_ids) >= params.max_tokens:
            reason = "length"
        else:
            request.on_event(Event(text, token, logprob=logprob))
            return token, None
        self._finish(request, reason, text=text + request.stream.flush(), token=token, logprob=logprob)
        return token, reason

    def _retire(self, requests: list[Request], finished: bool = False) -> None:
        """Take `requests` out of the running batch (cancelled ones are finished here)."""
        if not requests:
            return
        if not finished:
            for request in requests:
                self._finish(request, "cancelled")
        gone = set(map(id, requests))
        if finished and self.prefix_cache is not None:
            for row, request in enumerate(self._running):
                if id(request) in gone:
                    self.prefix_cache.store(self._batch.row(row, request.prompt_ids + request.output_ids))
        keep = [row for row, r in enumerate(self._running) if id(r) not in gone]
        self._running = [self._running[row] for row in keep]
        self._next = [self._next[row] for row in keep]
        if keep:
            self._batch.select(keep)
        else:
            self._batch = None
        if self.runtime is not None:
            self.runtime.end_sequences([r.id for r in requests])

    def _finish(self, request: Request, reason: str, text: str = "", token: int | None = None,
                error: str | None = None, logprob: TokenLogprob | None = None) -> None:
        request.finish_reason, request.finished_at = reason, time.perf_counter()
        self.counters.finished[reason] = self.counters.finished.get(reason, 0) + 1
        if self.on_finish is not None:
            self.on_finish(request)
        request.on_event(Event(text, token, reason, error, logprob))


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token from one row's logits ([V]): greedy at temperature 0, else temperature and
    nucleus (top-p) sampling with the request's own generator."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, 0) - sorted_probs < params.top_p  # the first always stays
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=generator))
