"""A predictor's guesses turned into what learned eviction ranks experts by: the chance that each
expert is used soon. For the current token and each forecast token t+h, an expert's chance of
being among the router's top-k is taken as k·softmax of its score (capped at 1); these are
averaged with weight γ^h, so the result lies in [0, 1] and the near future counts most."""

from __future__ import annotations

import torch

DISCOUNT = 0.85  # γ: the weight of token t+h relative to t+h-1 (best of 0.7, 0.85, 0.95 in a simulator sweep)


def chance_of_use(current: torch.Tensor, forecasts: torch.Tensor | None, top_k: int,
                  discount: float = DISCOUNT) -> torch.Tensor:
    """[..., L, E] chances in [0, 1] from the current token's scores [..., L, E] and forecasts
    [..., H, L, E] (None: the current token alone)."""
    steps = current.unsqueeze(-3) if forecasts is None else torch.cat([current.unsqueeze(-3), forecasts], dim=-3)
    selected = chance_selected(steps, top_k)  # [..., H+1, L, E]
    weights = discount ** torch.arange(steps.shape[-3], dtype=torch.float32)
    return torch.einsum("...hle,h->...le", selected, weights / weights.sum())


def chance_selected(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """[..., E] each expert's chance of being among the router's top-k: k·softmax, capped at 1."""
    return (top_k * torch.softmax(scores.float(), dim=-1)).clamp(max=1.0)
