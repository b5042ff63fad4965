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
    weights = _weights(steps.shape[-3], discount)
    later = (selected[..., 1:, :, :] * weights[1:]).sum(-3)
    return later + selected[..., 0, :, :] * weights[0], later


@functools.cache
def _weights(steps: int, discount: float) -> torch.Tensor:
    """[steps, 1, 1] the weights γ^h, summing to 1 (made once: the runtime asks at every token)."""
    weights = discount ** torch.arange(steps, dtype=torch.float32)
    return (weights / weights.sum())[:, None, None]


def chance_selected(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """[..., E] each expert's chance of being among the router's top-k: k·softmax, capped at 1."""
    return (top_k * torch.softmax(scores.float(), dim=-1)).clamp(max=1.0)
