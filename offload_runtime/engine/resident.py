"""`ResidentRuntime`: the runtime's face when the memory cap holds every expert.

The model is the plain transformers model, loaded whole: it runs its own forward with no hooks,
threads or cache, so it is at least as fast as transformers: with `expert_kernel` "streamed" its
experts run `expert_kernels.streamed_experts_forward` where they would run grouped_mm on the CPU
(the same numbers bit for bit, without grouped_mm's per-call work), with "gemv" its decode rows
through `rowdot.product` (the last bits differ, the weights stream faster). This object stands where an
`OffloadRuntime` would (`LoadedModel.runtime`): both are a `model_runtime.ModelRuntime`, so that
generate, serve and bench treat them alike: statistics, closing, the server's sequence bookkeeping.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from offload_runtime.engine.expert_kernels import GEMV, STREAMED, stream_experts
from offload_runtime.engine.mapped import MappedExperts
from offload_runtime.engine.memory_plan import MemoryPlan
from offload_runtime.engine.options import RuntimeOptions
from offload_runtime.engine.runtime import RuntimeStats
from prescient.arch import MoELayer
from prescient.fingerprint import ModelFingerprint


class ResidentRuntime:
    """Every expert resident: nothing to load, so every access hits (see the module doc)."""

    def __init__(self, model: nn.Module, layers: list[MoELayer], fingerprint: ModelFingerprint,
                 memory_plan: MemoryPlan, options: RuntimeOptions) -> None:
        self.model, self.layers, self.fingerprint, self.memory_plan = model, layers, fingerprint, memory_plan
        self.options = options  # `options.expert_kernel` computes the experts; the rest shaped the plan
        expert_kernel = options.expert_kernel
        if expert_kernel in (STREAMED, GEMV):
            stream_experts(model, expert_kernel)
        if expert_kernel == GEMV:  # the experts mapped from the checkpoint (`mapped`)
            for module in model.modules():
                if isinstance(module, MappedExperts):
                    module.use_matvec()
        self.top_k, self.n_experts = layers[0].top_k, layers[0].num_experts
        self.forwards = 0
        self._handle = model.register_forward_pre_hook(self._count)  # one call per forward, not per layer

    def _count(self, *_args) -> None:
        self.forwards += 1

    @contextmanager
    def rows(self, ids: list) -> Iterator[None]:
        """Serving: the forwards inside are over the sequences `ids`; nothing here keeps per-sequence state."""
        yield

    def end_sequences(self, ids: list) -> None:
        """Serving: nothing to forget."""

    def stats(self) -> RuntimeStats:
        plan = self.memory_plan
        return RuntimeStats(forwards=self.forwards, accesses=0, hits=0, misses=0, prefetch_inserts=0, prefetch_hits=0,
                            wasted_prefetches=0, evictions=0, prefetch_accuracy=0.0, hit_rate=1.0, bytes_moved=0,
                            loads=0, demand_loads=0, prefetch_loads=0, stall_seconds=0.0, late_tables=0,
                            tables_on_time=0, slots=plan.total_experts, slot_bytes=plan.total_experts * plan.expert_bytes)

    def close(self) -> None:
        """Remove the forward counter; safe to call twice."""
        self._handle.remove()

    def __enter__(self) -> "ResidentRuntime":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
