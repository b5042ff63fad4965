"""SiDA's hash-building thread: runs the predictor beside the inference thread.

The inference thread submits each forward's new input ids (the whole prompt at prefill, the
sampled tokens at each decode step) and goes on; this thread feeds them to the predictor, token
by token (causal, incremental), and publishes one hash table per forward: per MoE layer, the
predicted expert scores summed over the forward's tokens. Each token stream (an encoder-decoder
has two: the encoder's prompt and the decoder's tokens) keeps its own predictor state. The
inference thread only polls: a table not ready when a layer needs it is late, and that layer
proceeds with demand loads. With forecast heads a table can also carry chances of use soon
(learned eviction) and the next forward's chances of use (cross-token prefetch).

Serving decodes many sequences in one batch whose rows come and go: `submit(..., rows=ids)` names
each row's sequence, and each (stream, sequence) keeps its own batch-1 state, started the first time
that sequence is seen and stepped over its real tokens only; `forget(ids)` drops the states of
sequences that ended.

Requests queue without bound, and `poll` never waits: a predictor slower than the model falls
behind and its tables arrive late. `wait(step, timeout)` is SiDA's own rule instead (its inference
thread idles until the batch's table is popped): block until the table lands, at most `timeout`.
A failure of the predictor stops the thread and is raised, as `HashBuilderError`, by every later
`submit`, `poll` or `wait`.

Inline (`threaded=False`, the runtime's choice where the slots are on the CPU) there is no thread:
`submit` predicts at once and the table is ready when it returns. On a CPU machine the thread's
work is small (0.16 ms a token for the demo's SiDA predictor's fused step with cold caches,
`predictor.sida_decode`) but it runs
Python, and its turns at the GIL delayed the inference thread by more than that; inline, the cost
is the work itself, and the runtime can time it (`OffloadRuntime.predictor_seconds`).

`sleep(True)` (the prediction guard pausing predictions) keeps what is submitted without
predicting; after `sleep(False)` the next `submit` first steps the states over what was kept
(without forecasts: those tables are moot). A stream keeps its last `catch_up` tokens at most (its
state restarts from them): a sleep costs nothing even once it is long, where stepping over every
token slept through would cost the predictor's whole work, only later (0.15-0.2 ms a token on
runs/tb); the guard's sleeps last 32 to 128 misses of the cache and more, often dozens of forwards.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from prescient.errors import PrescientError
from prescient.memory_cap import anonymous_bytes, release_free_memory

log = logging.getLogger(__name__)

CATCH_UP = 64  # tokens a stream keeps while the predictor sleeps: what its state restarts from (see the module doc)


class HashBuilderError(PrescientError, RuntimeError):
    """The hash-building thread failed (the predictor raised) or was closed; the cause is chained."""


@dataclass(frozen=True)
class _Forget:
    rows: frozenset


@dataclass
class HashTable:
    step: int  # forward number it belongs to
    scores: torch.Tensor  # [L, E]: predicted scores summed over the forward's (unpadded) tokens
    tokens: int  # how many tokens were summed
    chances: torch.Tensor | None = None  # [L, E] chance of use soon after the forward's last token (learned eviction)
    later_chances: torch.Tensor | None = None  # [L, E] the same, from the next forward on (a layer this one has run)
    next_chances: torch.Tensor | None = None  # [L, E] chance the next forward uses each expert (cross-token prefetch)


_Forecasts = tuple[torch.Tensor | None, ...]  # HashTable's chances, later_chances and next_chances


class HashBuilder:
    """Owns the predictor's decode state; only its thread touches the predictor."""

    def __init__(self, predictor: Any, keep: int = 4, join_timeout: float = 10.0, forecasts: bool = False,
                 next_token: bool = False, threaded: bool = True, catch_up: int = CATCH_UP) -> None:
        self.predictor = predictor
        self.forecasts = forecasts  # tables also carry chances of use from the forecast heads
        self.next_token = next_token  # tables also carry the next forward's chances (forecast head t+1)
        self.keep = keep  # tables kept for polling: the newest `keep` forwards
        self.join_timeout = join_timeout
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._tables: dict[int, HashTable] = {}
        self._lock = threading.Lock()
        self._landed = threading.Condition(self._lock)  # a table landed, or the thread stopped
        self._error: BaseException | None = None
        self._closed = False
        self._states: dict[int, Any] = {}  # per stream, the predictor's decode state (None is a valid state)
        # inline (threaded=False): `submit` predicts at once, on the caller's thread
        self.threaded = threaded
        self._asleep = False  # see `sleep`
        self._held: list = []  # requests submitted while asleep, in order
        self.catch_up = catch_up  # tokens a stream keeps while asleep (see `_trim_held`)
        self._thread = threading.Thread(target=self._run, name="hash-builder", daemon=True)
        if threaded:
            self._thread.start()

    def submit(self, step: int, input_ids: torch.Tensor, new_sequence: bool,
               attention_mask: torch.Tensor | None = None, stream: int = 0,
               rows: list[Hashable] | None = None) -> None:
        """Queue forward `step`'s new ids ([B, T]) of token `stream`; `attention_mask` ([B, T],
        0 = padding) keeps padding out of the table (a padded row's state still steps over it: the
        predictor steps all rows at once). `new_sequence` starts the stream's state afresh.
        `rows` (one sequence id per row): per-sequence states instead (see the module doc);
        `new_sequence` is then ignored."""
        self._raise_pending()
        if self._closed:
            raise HashBuilderError("the hash-building thread is closed")
        mask = None if attention_mask is None else attention_mask.detach().to("cpu")
        rows = None if rows is None else list(rows)
        request = (step, input_ids.detach().to("cpu"), new_sequence, mask, stream, rows, True)
        if new_sequence and rows is None and self._held:  # the stream starts afresh: what it held before is moot
            self._held = [r for r in self._held if isinstance(r, _Forget) or r[4] != stream or r[5] is not None]
        if self._asleep:
            self._held.append(request)
            if rows is None:
                self._trim_held(stream)
            return
        if self._held:  # woken: catch the predictor's states up first (their tables are moot: no forecasts)
            held, self._held = self._held, []
            for earlier in held:
                self._serve(earlier if isinstance(earlier, _Forget) else (*earlier[:-1], False))
        self._serve(request)

    def _serve(self, request: Any) -> None:
        if self.threaded:
            self._requests.put(request)
        elif not self._handle(request):
            if not isinstance(self._error, Exception):
                raise self._error  # inline: a Ctrl-C stays a Ctrl-C
            self._raise_pending()

    def _trim_held(self, stream: int) -> None:
        """Keep the requests of token `stream` (without per-sequence rows) that hold its last
        `catch_up` tokens; the first kept starts the stream's state afresh when it is served."""
        mine = [i for i, r in enumerate(self._held) if not isinstance(r, _Forget) and r[4] == stream and r[5] is None]
        tokens = 0
        for kept, index in enumerate(reversed(mine), start=1):
            tokens += self._held[index][1].shape[1]
            if tokens >= self.catch_up:
                dropped = set(mine[:len(mine) - kept])
                if dropped:
                    first = self._held[index]
                    self._held[index] = (first[0], first[1], True, *first[3:])  # a fresh state, stepped from here
                    self._held = [r for i, r in enumerate(self._held) if i not in dropped]
                return

    def forget(self, rows: list[Hashable]) -> None:
        """Drop the per-sequence states of `rows` (queued: only the thread touches states)."""
        if self._closed:
            return
        if self._asleep:
            self._held.append(_Forget(frozenset(rows)))
        else:
            self._serve(_Forget(frozenset(rows)))

    def sleep(self, asleep: bool = True) -> None:
        """Stop predicting (`asleep`) or go on (False). Asleep, `submit` and `forget` only keep
        what they are handed: no table lands and the predictor costs nothing; the first `submit`
        after waking runs what was kept, in order (a stream's last `catch_up` tokens at most)."""
        self._asleep = asleep

    def poll(self, step: int) -> HashTable | None:
        """The table of forward `step` if it is ready now, else None; never waits."""
        self._raise_pending()
        with self._lock:
            return self._tables.get(step)

    def wait(self, step: int, timeout: float) -> HashTable | None:
        """The table of forward `step`, waiting at most `timeout` seconds for it; None if it has
        not landed by then (or never will: the thread stopped)."""
        self._raise_pending()
        with self._landed:
            self._landed.wait_for(lambda: step in self._tables or self._error is not None or self._closed
                                  or not self._thread.is_alive(), timeout if self.threaded else 0)
            table = self._tables.get(step)
        self._raise_pending()
        return table

    def close(self) -> None:
        """Drop queued requests and stop the thread (a running prediction finishes). Idempotent;
        never raises: a failure not yet raised by `submit`/`poll` was logged by the thread."""
        self._closed = True
        with self._landed:
            self._landed.notify_all()
        if not self.threaded:
            return
        self._requests.put(None)
        self._thread.join(self.join_timeout)
        if self._thread.is_alive():
            log.warning("hash-building thread still predicting after %.0f s; leaving it (daemon thread)",
                        self.join_timeout)

    def _raise_pending(self) -> None:
        if self._error is not None:
            raise HashBuilderError(f"the hash-building thread failed: {self._error!r}") from self._error

    @torch.inference_mode()
    def _predict(self, input_ids: torch.Tensor, new_sequence: bool, mask: torch.Tensor | None,
                 stream: int, forecast: bool = True) -> tuple[torch.Tensor, int, _Forecasts]:
        if new_sequence or stream not in self._states:
            self._states[stream] = self.predictor.start(input_ids.shape[0])
        state = self._states[stream]
        if mask is not None:
            mask = mask[:, -input_ids.shape[1]:].float()
        scores = None
        for position in range(input_ids.shape[1]):  # causal, incremental: each token seen once
            step_scores = self.predictor.step(state, input_ids[:, position]).float()  # [B, L, E]
            if mask is not None:
                step_scores = step_scores * mask[:, position, None, None]
            summed = step_scores.sum(0)
            scores = summed if scores is None else scores + summed
        tokens = int(mask.sum()) if mask is not None else input_ids.numel()
        return scores, tokens, self._forecasts(state, step_scores) if forecast else (None, None, None)

    @torch.inference_mode()
    def _predict_rows(self, input_ids: torch.Tensor, mask: torch.Tensor | None, stream: int,
                      rows: list[Hashable], forecast: bool = True) -> tuple[torch.Tensor, int, _Forecasts]:
        """Each row with its own sequence's batch-1 state, over the row's real tokens only."""
        scores, tokens, forecasts = None, 0, (None, None, None)
        for row, sequence in enumerate(rows):
            key = (stream, sequence)
            if key not in self._states:
                self._states[key] = self.predictor.start(1)
            state = self._states[key]
            real = range(input_ids.shape[1]) if mask is None else \
                mask[row, -input_ids.shape[1]:].nonzero().flatten().tolist()
            for position in real:
                step_scores = self.predictor.step(state, input_ids[row:row + 1, position]).float()
                scores = step_scores.sum(0) if scores is None else scores + step_scores.sum(0)
                tokens += 1
            if real and forecast:
                forecasts = tuple(row if seen is None else torch.maximum(seen, row)
                                  for seen, row in zip(forecasts, self._forecasts(state, step_scores)))
        if scores is None:  # no real token at all
            scores = torch.zeros(self.predictor.n_layers, self.predictor.n_experts)
        return scores, tokens, forecasts

    def _forecasts(self, state: Any, last_scores: torch.Tensor) -> _Forecasts:
        """After the state's last token, the largest over its rows of: [L, E] chances of use soon
        from this token and from the next one on (if `forecasts`), and [L, E] chances of use by
        the next token (if `next_token`)."""
        if not (self.forecasts or self.next_token):
            return None, None, None
        soon, later, next_token = (chances.amax(0) for chances in self.predictor.chances_of_use(
            state, last_scores, self.predictor.meta.fingerprint.top_k))
        return (soon if self.forecasts else None, later if self.forecasts else None,
                next_token if self.next_token else None)

    def _run(self) -> None:
        while True:
            request = self._requests.get()
            if request is None or self._closed or not self._handle(request):
                return

    def _handle(self, request: Any) -> bool:
        """Serve one request (a forward's ids, or sequences to forget); False once the predictor failed."""
        if isinstance(request, _Forget):
            self._states = {k: v for k, v in self._states.items()
                            if not (isinstance(k, tuple) and k[1] in request.rows)}
            return True
        step, input_ids, new_sequence, mask, stream, rows, forecast = request
        try:
            if rows is None:
                scores, tokens, forecasts = self._predict(input_ids, new_sequence, mask, stream, forecast)
            else:
                scores, tokens, forecasts = self._predict_rows(input_ids, mask, stream, rows, forecast)
        except BaseException as exc:  # raised in the inference thread by submit() / poll()
            log.error("hash-building thread failed at forward %d: %r", step, exc)
            with self._landed:
                self._error = exc
                self._landed.notify_all()
            return False
        with self._landed:
            self._tables = {s: t for s, t in self._tables.items() if s > step - self.keep}
            self._tables[step] = HashTable(step, scores, tokens, *forecasts)
            self._landed.notify_all()
        return True


def warm_up(predictor: Any, forecasts: bool, next_token: bool, tokens: int = 16) -> int:
    """Run `predictor` as the hash-building thread runs it while decoding, on a thread of its
    own, over a prompt and `tokens` decode steps; returns how much anonymous memory the process
    gained meanwhile, measured while the predictor still holds it (its state, its forecasts, the
    thread's allocator arena), less what stays once it is closed (compiled code loaded at its first
    step, which the process's footprint measured after this counts): what a memory plan must leave
    it beyond the footprint. A later thread takes over the arena the warm-up thread leaves."""
    release_free_memory()
    before = anonymous_bytes()
    builder = HashBuilder(predictor, forecasts=forecasts, next_token=next_token)
    try:
        builder.submit(0, torch.arange(tokens).unsqueeze(0), True)
        for step in range(1, tokens + 1):
            builder.submit(step, torch.tensor([[step]]), False)
        builder.wait(tokens, timeout=60.0)
    except HashBuilderError as exc:  # a predictor that knows only its own sequences (the oracle): what it held
        log.info("the predictor's warm-up stopped early (%s); measured what it held until then", exc.__cause__)
    finally:
        grown = max(0, anonymous_bytes() - before)
        builder.close()
    del builder  # its states with it: what stays is the predictor's own
    release_free_memory()
    return max(0, grown - max(0, anonymous_bytes() - before))
