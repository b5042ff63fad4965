"""Lookahead inside the token: MoE layer l+a's experts guessed from MoE layer l's input hidden
state (the MoE block's input, after the post-attention norm), a = 1..`ahead` layers ahead.

`HiddenLookahead` is the base of every such predictor and owns the hooks: `attach(callback)`
registers forward pre-hooks on every MoE block (found with `prescient.arch.find_moe_layers`);
when block l runs, it calls `callback(l + a, logits)` for a = 1..`ahead` (nearest first) with
`lookahead(l, hidden, a)`. Layer 0 has no earlier MoE block: its guess is layer 0's own router
on its own input, which is exact, so compare predictors on layers 1..L−1. `block_input_hooks`
is the same hook for anything else that reads block inputs (tracing hidden states).

`predict` / `step` run the model itself (with a KV cache when decoding) and collect what the
hooks saw, one layer ahead; `predict_ahead` gives every offset from one forward. These run the
live model: a baseline to measure, not a cheap predictor. Decoder-only models.

Kinds:
- `GateLookahead` (HybriMoE, AdapMoE): layer l+a's own router on layer l's input. Hidden states
  change little from one layer to the next (the residual stream), so it is a good early guess
  at the cost of one small matmul.
- `predictor.probe.ProbeLookahead`: a small trained network per (layer, offset).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from predictor.base import ExpertPredictor, PredictorError, PredictorMeta, register_predictor
from prescient.arch import MoELayer, find_moe_layers, is_encoder_decoder
from prescient.fingerprint import fingerprint_model

Callback = Callable[[int, torch.Tensor], None]  # (target layer, logits [..., E])
InputCallback = Callable[[int, torch.Tensor], None]  # (MoE layer, its block input [..., H])


def block_input_hooks(layers: Sequence[MoELayer], on_input: InputCallback) -> list[torch.utils.hooks.RemovableHandle]:
    """Forward pre-hooks calling `on_input(layer index, block input)` whenever an MoE block runs."""
    def hook(index: int):
        def pre_hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            on_input(index, args[0] if args else kwargs["hidden_states"])
        return pre_hook

    return [layer.block.register_forward_pre_hook(hook(layer.index), with_kwargs=True) for layer in layers]


@contextmanager
def recording_block_inputs(layers: Sequence[MoELayer]) -> Iterator[dict[int, torch.Tensor]]:
    """Within the block, a dict that holds each MoE layer's last block input (layer index -> tensor)."""
    seen: dict[int, torch.Tensor] = {}
    handles = block_input_hooks(layers, seen.__setitem__)
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


@dataclass
class LookaheadState:
    past_key_values: Any = None


class HiddenLookahead(ExpertPredictor):
    """Base of the predictors that guess layer l+a from layer l's block input (module doc).
    Subclasses implement `_lookahead`; `max_ahead` bounds the offsets they know."""

    ahead: int = 1  # how many layers ahead `attach` emits

    def __init__(self) -> None:
        self.model: nn.Module | None = None
        self.layers: list[MoELayer] = []
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._callbacks: list[Callback] = []

    def bind(self, model: nn.Module) -> "HiddenLookahead":
        """Run on `model` (whose fingerprint must be this predictor's); returns self."""
        layers = find_moe_layers(model)
        fingerprint_model(model, layers).require_same(self.meta.fingerprint, f"{self.kind} predictor")
        if self._handles:
            raise PredictorError("detach every callback before binding the predictor to another model")
        self.model, self.layers = model, layers
        return self

    @property
    def max_ahead(self) -> int:
        """The farthest offset `lookahead` answers."""
        return self.n_layers - 1

    def lookahead(self, layer: int, hidden: torch.Tensor, ahead: int = 1) -> torch.Tensor:
        """Logits [..., E] for MoE layer `layer` + `ahead` from MoE layer `layer`'s block input `hidden` [..., H]."""
        if not 1 <= ahead <= self.max_ahead:
            raise PredictorError(f"this {self.kind!r} predictor looks 1..{self.max_ahead} layers ahead, not {ahead}"
                                 f"{self.ahead_hint(ahead)}")
        if not 0 <= layer < self.n_layers - ahead:
            raise PredictorError(f"MoE layer {layer} has no next MoE layer {ahead} ahead "
                                 f"(model has {self.n_layers})")
        return self._lookahead(layer, hidden, ahead)

    def ahead_hint(self, ahead: int) -> str:
        """What to do for an offset beyond `max_ahead` ("; ..."), if anything can be done."""
        return ""

    @abstractmethod
    def _lookahead(self, layer: int, hidden: torch.Tensor, ahead: int) -> torch.Tensor:
        """`lookahead` once its arguments are checked."""

    def _require_model(self) -> nn.Module:
        if self.model is None:
            raise PredictorError(f"this {self.kind!r} predictor runs the live model: bind(model) first")
        return self.model

    @staticmethod
    def _route(target: MoELayer, hidden: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            logits, _ = target.adapter.routing(target, target.router(hidden))
        return logits.reshape(*hidden.shape[:-1], logits.shape[-1])

    def _hook(self, index: int, hidden: torch.Tensor) -> None:
        if index == 0:
            self._emit(0, self._route(self.layers[0], hidden))
        with torch.no_grad():
            for ahead in range(1, min(self.ahead, self.n_layers - 1 - index) + 1):
                self._emit(index + ahead, self.lookahead(index, hidden, ahead))

    def _emit(self, layer: int, logits: torch.Tensor) -> None:
        for callback in self._callbacks:
            callback(layer, logits)

    def attach(self, callback: Callback) -> None:
        """Call `callback(layer, logits)` with each layer's early guesses while the model runs."""
        self._require_model()
        if not self._handles:
            self._handles = block_input_hooks(self.layers, self._hook)
        self._callbacks.append(callback)

    def detach(self, callback: Callback) -> None:
        self._callbacks.remove(callback)
        if not self._callbacks:
            for handle in self._handles:
                handle.remove()
            self._handles = []

    def block_inputs(self, input_ids: torch.Tensor, state: LookaheadState | None = None) -> list[torch.Tensor]:
        """Each MoE layer's block input [B, T, H] while the model reads `input_ids` [B, T]."""
        model = self._require_model()
        if is_encoder_decoder(model):
            raise PredictorError(f"{self.kind} predict/step runs decoder-only models; use attach() for others")
        with recording_block_inputs(self.layers) as seen, torch.no_grad():
            past = state.past_key_values if state is not None else None
            out = model(input_ids=input_ids, past_key_values=past, use_cache=state is not None)
        if state is not None:
            state.past_key_values = out.past_key_values
        return [seen[i].reshape(*input_ids.shape, -1) for i in range(len(self.layers))]

    def scores(self, inputs: list[torch.Tensor], ahead: int = 1) -> torch.Tensor:
        """Scores [..., L, E] from the block inputs: layer j from layer j − `ahead`'s input; the
        layers j < `ahead` from layer 0's (j = 0: its own router, exact)."""
        with torch.no_grad():
            layers = [self._route(self.layers[0], inputs[0])]
            layers += [self.lookahead(max(j - ahead, 0), inputs[max(j - ahead, 0)], min(j, ahead))
                       for j in range(1, len(inputs))]
        return torch.stack([s.float() for s in layers], dim=-2)

    def predict_ahead(self, input_ids: torch.Tensor, aheads: Sequence[int]) -> dict[int, torch.Tensor]:
        """{a: scores [B, T, L, E] with every layer guessed `a` layers ahead (`scores`)}, one forward."""
        inputs = self.block_inputs(input_ids)
        return {a: self.scores(inputs, a) for a in aheads}

    def predict(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.scores(self.block_inputs(input_ids))

    def start(self, batch_size: int) -> LookaheadState:
        return LookaheadState()

    def step(self, state: LookaheadState, token_ids: torch.Tensor) -> torch.Tensor:
        return self.scores(self.block_inputs(token_ids[:, None], state))[:, 0]


@register_predictor
class GateLookahead(HiddenLookahead):
    kind = "gate-lookahead"

    def __init__(self, model: nn.Module, ahead: int = 1):
        super().__init__()
        self.model, self.layers = model, find_moe_layers(model)
        self.meta = PredictorMeta(self.kind, fingerprint_model(model, self.layers))
        self.ahead = ahead

    def _lookahead(self, layer: int, hidden: torch.Tensor, ahead: int) -> torch.Tensor:
        return self._route(self.layers[layer + ahead], hidden)
