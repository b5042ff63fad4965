"""SiDA's hash-building thread: runs the predictor beside the inference thread.

The inference thread submits each forward's new input ids (the whole prompt at prefill,
the sampled token at each decode step) and goes on; this thread turns them into hash
tables — per MoE layer, predicted expert scores — and hands them over through a bounded
queue. The inference thread only polls: when a table is not ready by the time a layer
needs it, the layer proceeds with demand loads (the runtime counts the table late).
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass
class HashTable:
    step: int  # forward number it belongs to
    scores: torch.Tensor  # [L, E]: predicted scores summed over the forward's tokens


class HashBuilder:
    """Owns the predictor's decode state; only its thread touches the predictor."""

    def __init__(self, predictor, queue_size: int = 4):
        self.predictor = predictor
        self._requests: queue.Queue = queue.Queue(maxsize=queue_size)
        self._tables: dict[int, HashTable] = {}
        self._ready = threading.Condition()
        self._error: BaseException | None = None
        self._state = None
        self._thread = threading.Thread(target=self._run, name="hash-builder", daemon=True)
        self._thread.start()

    def submit(self, step: int, input_ids: torch.Tensor, new_sequence: bool) -> None:
        """Queue the ids of forward `step` ([B, T]); raises if the thread has failed."""
        request = (step, input_ids.detach().to("cpu"), new_sequence)
        while True:
            self._raise_pending()
            try:
                self._requests.put(request, timeout=0.1)
                return
            except queue.Full:
                continue

    def poll(self, step: int) -> HashTable | None:
        """The table of forward `step` if it is ready now, else None; never waits."""
        self._raise_pending()
        with self._ready:
            return self._tables.get(step)

    def close(self) -> None:
        if self._thread.is_alive():
            self._requests.put(None)
            self._thread.join(timeout=10)
        self._raise_pending()

    def _raise_pending(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("the hash-building thread failed") from error

    @torch.inference_mode()
    def _predict(self, input_ids: torch.Tensor, new_sequence: bool) -> torch.Tensor:
        if new_sequence or self._state is None:
            self._state = self.predictor.start(input_ids.shape[0])
        scores = None
        for position in range(input_ids.shape[1]):  # causal, incremental: each token seen once
            step_scores = self.predictor.step(self._state, input_ids[:, position])  # [B, L, E]
            scores = step_scores.sum(0) if scores is None else scores + step_scores.sum(0)
        return scores

    def _run(self) -> None:
        while True:
            request = self._requests.get()
            if request is None:
                return
            step, input_ids, new_sequence = request
            try:
                scores = self._predict(input_ids, new_sequence)
            except BaseException as exc:  # surfaced in the inference thread by submit()/table()
                log.error("hash-building thread failed: %s", exc)
                self._error = exc
                return
            with self._ready:
                self._tables = {s: t for s, t in self._tables.items() if s > step - 4}
                self._tables[step] = HashTable(step, scores)
                self._ready.notify_all()
