"""In-token lookahead (after HybriMoE's prefetch from the next layers' gates, ordered by layer rather than
by HybriMoE's impact score): when MoE block l starts, the routers
of the next `ahead` MoE layers are applied to its input hidden state (or a trained probe per
layer reads it, `predictor.probe`, after Zhu et al.), and the experts they pick
are prefetched, the nearest layer first, each layer's by summed router probability. The guess is
made in the block's pre-hook and requested once the block's own experts are pinned (`issue`,
called by the runtime's `use`), so a lookahead prefetch never evicts what block l is about to use.

The residual stream changes little from one layer to the next, so layer l+a's router on layer
l's input is an early guess of layer l+a's choice; it gives the copy a lead of a layers'
compute, which SiDA's per-token table (made before the token's first layer, from token ids
only) cannot sharpen. The guess costs one [tokens, H] x [H, E] matmul per layer ahead, on the
inference thread (the hidden state exists only there); the copies run on the transfer workers.
HybriMoE prefetches by "impact" (the stall a copy saves): a nearer layer's copy saves more, and
the transfer queue serves these before the hash table's prefetches of the same forward.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from cache import Key
from prescient.arch import MoELayer

# above every prefetch of the hash table's for the same forward (see `prefetch.STEP_PRIORITY`),
# below every demand load; a nearer layer's keys before a farther one's
_LAYER_PRIORITY = 2.0**16


class Prefetches(Protocol):
    """What the lookahead needs of the runtime."""

    step: int

    def prefetch(self, keys: list[Key], priority: float = 0.0) -> list[Key]: ...


class Guess(Protocol):
    """Logits [..., E] of MoE layer `layer` + `ahead` from MoE layer `layer`'s block input [..., H]
    (`predictor.probe.ProbeLookahead.lookahead` is one)."""

    def __call__(self, layer: int, hidden: torch.Tensor, ahead: int) -> torch.Tensor: ...


class InTokenLookahead:
    """Forward pre-hooks on every MoE block of `layers`: each guesses the next `ahead` layers of
    its stack from its input, with their own routers or with `guess` (a trained probe); `issue(layer)`
    hands the guess to `runtime.prefetch`."""

    def __init__(self, runtime: Prefetches, layers: list[MoELayer], stacks: list[range], ahead: int,
                 per_token: int, step_priority: float, guess: Guess | None = None) -> None:
        self.runtime, self.layers, self.ahead, self.per_token = runtime, layers, ahead, per_token
        self.step_priority = step_priority
        self.guess = guess or self._route
        self.stack_end = {i: stack.stop for stack in stacks for i in stack}  # no guess across a stack's end
        self.issued = 0  # keys inserted by lookahead prefetches
        self._guessed: dict[int, list[Key]] = {}  # block -> keys guessed at its start, not yet issued
        self._handles = [layer.block.register_forward_pre_hook(self._hook(layer.index), with_kwargs=True)
                         for layer in layers]

    def keys(self, layer: int, hidden: torch.Tensor) -> list[Key]:
        """The keys to prefetch when MoE block `layer` starts on `hidden` [..., H]: per layer ahead
        (nearest first), the union of each token's top `per_token` experts, by summed probability."""
        keys: list[Key] = []
        for target in range(layer + 1, min(layer + 1 + self.ahead, self.stack_end[layer])):
            logits = self.guess(layer, hidden, target - layer)
            probs = torch.softmax(logits.reshape(-1, logits.shape[-1]).float(), dim=-1)
            top = torch.topk(probs, min(self.per_token, probs.shape[-1]), dim=-1).indices
            chosen = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, top, True)
            order = torch.argsort((probs * chosen).sum(0), descending=True)[: int(chosen.any(0).sum())]
            keys += [(target, int(e)) for e in order.tolist()]
        return keys

    def _route(self, layer: int, hidden: torch.Tensor, ahead: int) -> torch.Tensor:
        """Gate lookahead: layer `layer` + `ahead`'s own router on `hidden`."""
        moe = self.layers[layer + ahead]
        with torch.no_grad():
            logits, _ = moe.adapter.routing(moe, moe.router(hidden))
        return logits

    def _hook(self, layer: int):
        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            self._guessed[layer] = self.keys(layer, args[0] if args else kwargs["hidden_states"])
        return hook

    def issue(self, layer: int) -> None:
        """Prefetch what block `layer` guessed at its start (once; its own experts are pinned now)."""
        keys = self._guessed.pop(layer, None)
        if keys:
            priority = self.runtime.step * self.step_priority + _LAYER_PRIORITY
            self.issued += len(self.runtime.prefetch(keys, priority=priority))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
