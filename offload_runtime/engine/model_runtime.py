"""`ModelRuntime`: what `LoadedModel.runtime` is, whichever runtime `load_offloaded` made.

A model whose experts are offloaded runs with an `OffloadRuntime` (slots, transfers, the
predictor); one whose memory cap holds every expert with a `ResidentRuntime` (the plain model,
copied or mapped). `generate`, `serve` and `bench` use either through this protocol alone, and a test holds
both to it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

from torch import nn

from offload_runtime.engine.memory_plan import MemoryPlan
from offload_runtime.engine.options import RuntimeOptions
from offload_runtime.engine.runtime import RuntimeStats
from prescient.fingerprint import ModelFingerprint


@runtime_checkable
class ModelRuntime(Protocol):
    """The runtime of a loaded model, and what it holds: the `model`, the `options` it was
    loaded with, its `memory_plan` (None under a budget), its `fingerprint` (what predictors are
    checked against); the server runs each forward inside `rows` (each batch row's sequence: the
    state of the forward being run, not a setting)."""

    model: nn.Module
    options: RuntimeOptions
    fingerprint: ModelFingerprint
    memory_plan: MemoryPlan | None

    def stats(self) -> RuntimeStats:
        """Hits, misses, prefetches, loads and stalls since the model loaded."""

    def rows(self, ids: list) -> AbstractContextManager[None]:
        """Serving: the forwards run inside are over batch rows of the sequences `ids`, one id per row."""

    def end_sequences(self, ids: list) -> None:
        """Serving: forget what was kept for the sequences `ids`, which have ended."""

    def close(self) -> None:
        """Stop what the runtime runs (its threads, hooks); safe to call twice."""

    def __enter__(self) -> ModelRuntime: ...

    def __exit__(self, *exc: object) -> None: ...
