"""Prediction quality: how many of the router's experts a predictor's top-n finds."""

from __future__ import annotations

import torch


def recall_at(scores: torch.Tensor, true_topk: torch.Tensor, n: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Share of the router's top-k experts found among the predictor's top-`n` experts.

    scores [..., L, E], true_topk [..., L, k] (long), mask [...] (bool, True = count the token).
    Returns a scalar: the mean over counted tokens and layers of |pred_top_n ∩ true_topk| / k.
    """
    n = min(n, scores.shape[-1])
    predicted = scores.topk(n, dim=-1).indices  # [..., L, n]
    hits = (predicted.unsqueeze(-1) == true_topk.long().unsqueeze(-2)).any(dim=-2)  # [..., L, k]
    per_token = hits.float().mean(dim=(-1, -2))  # [...]
    if mask is None:
        return per_token.mean()
    mask = mask.to(per_token.dtype)
    return (per_token * mask).sum() / mask.sum().clamp_min(1)
