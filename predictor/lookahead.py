"""Gate-lookahead (HybriMoE, AdapMoE): the next MoE layer's router applied to the current
MoE layer's input hidden state. Hidden states change little from one layer to the next
(the residual stream), so layer l+1's router on layer l's input is a good early guess,
one layer ahead, at the cost of one small matmul.

It needs the live model: `attach(model)` registers forward pre-hooks on every MoE block
(found with `prescient.arch.find_moe_layers`); when block l runs, the hook scores layer
l+1 from block l's input and hands the logits to a callback (the runtime's prefetcher).
Layer 0 has no earlier MoE block: its guess is layer 0's own router on its own input,
which is exact, so compare predictors on layers 1..L−1.

`predict` / `step` run the model itself (with a KV cache when decoding) and collect what
the hooks saw: it is a baseline to measure, not a cheap predictor. Decoder-only models.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from predictor.base import ExpertPredictor, PredictorError, PredictorMeta, register_predictor
from prescient.arch import MoELayer, find_moe_layers, is_encoder_decoder
from prescient.fingerprint import fingerprint_model

Callback = Callable[[int, torch.Tensor], None]  # (target layer, logits [..., E])


@dataclass
class LookaheadState:
    past_key_values: Any = None


@register_predictor
class GateLookahead(ExpertPredictor):
    kind = "gate-lookahead"

    def __init__(self, model: nn.Module):
        self.model = model
        self.layers: list[MoELayer] = find_moe_layers(model)
        self.meta = PredictorMeta(self.kind, fingerprint_model(model, self.layers))
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._callbacks: list[Callback] = []

    def lookahead(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [..., E] for MoE layer `layer`+1 from MoE layer `layer`'s input `hidden` [..., D]."""
        if not 0 <= layer < len(self.layers) - 1:
            raise PredictorError(f"MoE layer {layer} has no next MoE layer (model has {len(self.layers)})")
        return self._route(self.layers[layer + 1], hidden)

    @staticmethod
    def _route(target: MoELayer, hidden: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            logits, _ = target.adapter.routing(target, target.router(hidden))
        return logits.reshape(*hidden.shape[:-1], logits.shape[-1])

    def _hook(self, index: int, _module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        if index == 0:
            self._emit(0, self._route(self.layers[0], hidden))
        if index + 1 < len(self.layers):
            self._emit(index + 1, self.lookahead(index, hidden))

    def _emit(self, layer: int, logits: torch.Tensor) -> None:
        for callback in self._callbacks:
            callback(layer, logits)

    def attach(self, callback: Callback) -> None:
        """Call `callback(layer, logits)` with each layer's early guess while the model runs."""
        if not self._handles:
            self._handles = [
                layer.block.register_forward_pre_hook(
                    lambda m, a, kw, i=layer.index: self._hook(i, m, a, kw), with_kwargs=True
                )
                for layer in self.layers
            ]
        self._callbacks.append(callback)

    def detach(self, callback: Callback) -> None:
        self._callbacks.remove(callback)
        if not self._callbacks:
            for handle in self._handles:
                handle.remove()
            self._handles = []

    @contextmanager
    def _collect(self) -> Iterator[dict[int, torch.Tensor]]:
        seen: dict[int, torch.Tensor] = {}
        callback: Callback = seen.__setitem__
        self.attach(callback)
        try:
            yield seen
        finally:
            self.detach(callback)

    def _run(self, input_ids: torch.Tensor, state: LookaheadState | None) -> torch.Tensor:
        """Scores [B, T, L, E] for `input_ids` [B, T], by running the model."""
        if is_encoder_decoder(self.model):
            raise PredictorError("gate-lookahead predict/step runs decoder-only models; use attach() for others")
        with self._collect() as seen, torch.no_grad():
            past = state.past_key_values if state is not None else None
            out = self.model(input_ids=input_ids, past_key_values=past, use_cache=state is not None)
        if state is not None:
            state.past_key_values = out.past_key_values
        return torch.stack([seen[i].float() for i in range(len(self.layers))], dim=-2)

    def predict(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._run(input_ids, None)

    def start(self, batch_size: int) -> LookaheadState:
        return LookaheadState()

    def step(self, state: LookaheadState, token_ids: torch.Tensor) -> torch.Tensor:
        return self._run(token_ids[:, None], state)[:, 0]
