"""A predictor's guesses turned into what learned eviction ranks experts by: the chance that each
expert is used soon. For the current token and each forecast token t+h, an expert's chance of
being among the router's top-k is taken as k·softmax of its score (capped at 1); these are
averaged with weight γ^h, so the result lies in [0, 1] and the near future counts most.

Once the current token has run a layer, that layer's experts are no longer used by it: their
chance counts from the next token on (the same weights with the current token's term left out,
so that it compares with the chances of the layers still to run)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import numba
import numpy as np
import torch

DISCOUNT = 0.85  # γ: the weight of token t+h relative to t+h-1 (best of 0.7, 0.85, 0.95 in a simulator sweep
#                  made before run layers took their later chances)


def chances_of_use(current: torch.Tensor, forecasts: torch.Tensor, top_k: int, discount: float = DISCOUNT,
                   to_chances: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """From the current token's scores [..., L, E] and forecasts [..., H, L, E]: the [..., L, E]
    chances in [0, 1] of use soon counted from the current token, and counted from the next one
    on (a layer the current token has run). `to_chances`: how scores become chances of being
    picked (the predictor's `chance_selected`; default `chance_selected` below)."""
    steps = torch.cat([current.unsqueeze(-3), forecasts], dim=-3)
    selected = (to_chances or chance_selected)(steps, top_k)  # [..., H+1, L, E]
    weights = discount_weights(steps.shape[-3], discount)[:, None, None]
    later = (selected[..., 1:, :, :] * weights[1:]).sum(-3)
    return later + selected[..., 0, :, :] * weights[0], later


@functools.cache
def discount_weights(steps: int, discount: float = DISCOUNT) -> torch.Tensor:
    """[steps] the weights γ^h, summing to 1 (made once: the runtime asks at every token)."""
    weights = discount ** torch.arange(steps, dtype=torch.float32)
    return weights / weights.sum()


def chance_selected(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """[..., E] each expert's chance of being among the router's top-k: k·softmax, capped at 1."""
    return (top_k * torch.softmax(scores.float(), dim=-1)).clamp(max=1.0)


def chances_of_use_compiled(current: torch.Tensor, forecasts: torch.Tensor, top_k: int, discount: float = DISCOUNT
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`chances_of_use` by `chance_selected` for [B, L, E] scores and [B, H, L, E] forecasts, with the
    next token's chances of selection, in one compiled call: the runtime asks once a token, on
    tensors of a few hundred numbers, where a dozen torch calls cost ~0.1 ms with the CPU's caches
    cold from the experts' weights. Float32, within 1e-6 of the torch formula (tested)."""
    current = np.ascontiguousarray(current.detach().float().numpy())
    ahead = np.ascontiguousarray(forecasts.detach().float().numpy())
    weights = discount_weights(ahead.shape[1] + 1, discount).numpy()
    soon, later, next_token = (np.empty(current.shape, np.float32) for _ in range(3))
    for row in range(len(current)):
        _chances_row(current[row], ahead[row], np.float32(top_k), weights, soon[row], later[row], next_token[row])
    return torch.from_numpy(soon), torch.from_numpy(later), torch.from_numpy(next_token)


@numba.njit(fastmath=True, nogil=True, cache=True)
def _chances_row(current, ahead, top_k, weights, soon, later, next_token):  # pragma: no cover - compiled
    """Per layer, each step's chance of selection (top_k·softmax, capped at 1), discounted and
    summed: from the next token on into `later`, with the current one into `soon`."""
    n_layers, n_experts = current.shape
    for layer in range(n_layers):
        later[layer] = 0.0
        for step in range(ahead.shape[0] + 1):
            scores = current[layer] if step == 0 else ahead[step - 1, layer]
            top = scores.max()
            total = np.float32(0.0)
            for e in range(n_experts):
                total += np.exp(scores[e] - top)
            for e in range(n_experts):
                chance = min(top_k * np.exp(scores[e] - top) / total, np.float32(1.0))
                if step == 0:
                    soon[layer, e] = weights[0] * chance
                else:
                    later[layer, e] += weights[step] * chance
                if step == 1:
                    next_token[layer, e] = chance
        for e in range(n_experts):
            soon[layer, e] += later[layer, e]
