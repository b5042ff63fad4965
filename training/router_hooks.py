"""Forward hooks on a model's routers that record each MoE layer's routing decision."""

from __future__ import annotations

from contextlib import contextmanager
from collections.abc import Iterator

import torch

from prescient.arch import MoELayer
from prescient.errors import TraceError


class RouterRecorder:
    """Collects, per MoE layer, the router logits and the selected experts of one forward."""

    def __init__(self, layers: list[MoELayer]):
        self.layers = layers
        self.logits: list[torch.Tensor | None] = [None] * len(layers)
        self.selected: list[torch.Tensor | None] = [None] * len(layers)

    def _hook(self, layer: MoELayer):
        def record(_module, _inputs, output):
            logits, selected = layer.adapter.routing(layer, output)
            if bool((selected >= layer.num_experts).any()):
                raise TraceError(f"MoE layer {layer.index} ({layer.name}) routed a token to a zero-computation "
                                 f"expert (id >= {layer.num_experts}); traces record k weight-holding experts per "
                                 "token, so this model cannot be traced")
            self.logits[layer.index] = logits.detach()
            self.selected[layer.index] = selected.detach()

        return record

    @contextmanager
    def recording(self) -> Iterator["RouterRecorder"]:
        handles = [layer.router.register_forward_hook(self._hook(layer)) for layer in self.layers]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def stacked(self, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [B, S, L, E], selected [B, S, L, k]) of the last forward: each layer's last S
        positions (a decoder that also read a start token has S + 1)."""
        missing = [i for i, t in enumerate(self.logits) if t is None]
        if missing:
            raise RuntimeError(f"MoE layers {missing} did not run in the last forward")

        def last(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(batch, -1, t.shape[-1])[:, -seq:]

        logits = torch.stack([last(t) for t in self.logits], dim=2)
        selected = torch.stack([last(t) for t in self.selected], dim=2)
        self.logits = [None] * len(self.layers)
        self.selected = [None] * len(self.layers)
        return logits, selected
