"""Training loss of the hash function: SiDA's λ·CE + truncated KD, plus named extra terms.

    loss = ce_weight · CE(student, router's top-1)                        SiDA's λ·L_CE
         + tkd_weight · TKD_T(student, teacher)                           SiDA's L_TKD(T)
         + topk_bce_weight · BCE(student, multi-hot of router's top-k)    extra
         + topk_ce_weight · mean_j∈top-k CE(student, j)                   extra

TKD: the teacher's T highest router logits and the student's logits at those same experts
are each renormalised over the T experts with a softmax at temperature τ; the distance is
either L1 (Σ|p_s − p_t|, as SiDA's public code does) or KL(p_t ‖ p_s)·τ² (Hinton's scaling,
which keeps gradients comparable across τ). With T ≥ E the truncation keeps every expert
and TKD is plain KD. The trace's own top-T bounds T.

The extra terms aim at what serving needs, the router's *set* of k experts (CE on the top-1
alone ignores experts 2..k). On the reference-shaped trace of the ablation they did not beat
SiDA's own terms (see configs/predictor/sida.yaml), so they default to off; on token-driven
routing, topk_ce speeds up the start of training. Every term is reported separately so the
module can log it.

Forecast heads (horizon H > 0) add, for h = 1..H,

    horizon_weights[h−1] · mean_j∈top-k(t+h) CE(forecast_h(t), j)      `forecast_loss`

over the tokens t whose token t+h exists in the same sequence. Token t+h is not known after
token t, so the forecast is a distribution over what may come: this cross-entropy is a proper
scoring rule for the share of each expert among the router's top-k, whose order is the order
recall@n ranks by (truncated KD would instead chase one possible token's logits). The terms of
the current token (`predictor_loss`) are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from prescient.errors import PrescientError


class LossConfigError(PrescientError, ValueError):
    """The loss configuration does not fit the model (e.g. a weight per horizon is missing)."""


@dataclass
class LossConfig:
    ce_weight: float = 0.005  # λ in SiDA
    tkd_weight: float = 1.0
    top_t: int = 30  # T in SiDA; capped by the trace's top-T
    temperature: float = 1.0  # τ
    distance: Literal["l1", "kl"] = "l1"
    topk_bce_weight: float = 0.0
    topk_ce_weight: float = 0.0
    horizon_weights: list[float] | None = None  # per forecast horizon 1..H; None: 0.5, 0.25, ... (halving)

    def forecast_weights(self, horizon: int) -> list[float]:
        """The weight of each forecast horizon 1..`horizon`; a list of another length is an error."""
        if self.horizon_weights is None:
            return [0.5**h for h in range(1, horizon + 1)]
        if len(self.horizon_weights) != horizon:
            raise LossConfigError(
                f"loss.horizon_weights has {len(self.horizon_weights)} value(s) but the horizon is {horizon}; "
                f"give one weight per forecast horizon, e.g. --model.loss.horizon_weights "
                f"[{', '.join(str(0.5**h) for h in range(1, horizon + 1))}]"
            )
        return list(self.horizon_weights)


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` [..., L] over the tokens where `mask` [...] is True, and over layers."""
    weights = mask.to(values.dtype).unsqueeze(-1).expand_as(values)
    return (values * weights).sum() / weights.sum().clamp_min(1)


def truncated_kd(
    student: torch.Tensor,
    teacher_ids: torch.Tensor,
    teacher_logits: torch.Tensor,
    top_t: int,
    temperature: float = 1.0,
    distance: str = "l1",
) -> torch.Tensor:
    """Per-token-and-layer TKD distance [..., L] (see module doc).

    student [..., L, E]; teacher_ids / teacher_logits [..., L, T'] sorted best first.
    """
    t = min(top_t, teacher_ids.shape[-1])
    student_t = student.gather(-1, teacher_ids[..., :t].long()) / temperature
    teacher_t = teacher_logits[..., :t].to(student.dtype) / temperature
    if distance == "l1":
        return (student_t.softmax(-1) - teacher_t.softmax(-1)).abs().sum(-1)
    if distance == "kl":
        log_p_t = teacher_t.log_softmax(-1)
        return (log_p_t.exp() * (log_p_t - student_t.log_softmax(-1))).sum(-1) * temperature**2
    raise ValueError(f"unknown TKD distance {distance!r}; use 'l1' or 'kl'")


def predictor_loss(
    student: torch.Tensor,
    topk_ids: torch.Tensor,
    topt_ids: torch.Tensor,
    topt_logits: torch.Tensor,
    mask: torch.Tensor,
    config: LossConfig,
) -> dict[str, torch.Tensor]:
    """All loss terms, each a scalar averaged over counted tokens and layers, and their
    weighted sum under "loss". student [B, T, L, E], topk_ids [B, T, L, k], mask [B, T]."""
    topk_ids = topk_ids.long()
    terms: dict[str, torch.Tensor] = {}
    weights: dict[str, float] = {}

    log_probs = student.log_softmax(-1)
    if config.ce_weight:
        terms["ce"] = _masked_mean(-log_probs.gather(-1, topk_ids[..., :1]).squeeze(-1), mask)
        weights["ce"] = config.ce_weight
    if config.tkd_weight:
        tkd = truncated_kd(student, topt_ids, topt_logits, config.top_t, config.temperature, config.distance)
        terms["tkd"] = _masked_mean(tkd, mask)
        weights["tkd"] = config.tkd_weight
    if config.topk_bce_weight:
        target = torch.zeros_like(student).scatter_(-1, topk_ids, 1.0)
        bce = F.binary_cross_entropy_with_logits(student, target, reduction="none").sum(-1)
        terms["topk_bce"] = _masked_mean(bce, mask)
        weights["topk_bce"] = config.topk_bce_weight
    if config.topk_ce_weight:
        terms["topk_ce"] = _masked_mean(-log_probs.gather(-1, topk_ids).mean(-1), mask)
        weights["topk_ce"] = config.topk_ce_weight
    if not terms:
        raise ValueError("every loss weight is zero; set at least one of ce/tkd/topk_bce/topk_ce weights")
    terms["loss"] = sum(weights[name] * value for name, value in terms.items())
    return terms


def forecast_loss(
    forecasts: torch.Tensor,
    future_topk_ids: torch.Tensor,
    future_mask: torch.Tensor,
    weights: list[float],
) -> dict[str, torch.Tensor]:
    """Forecast terms "forecast_h1".."forecast_hH" (see module doc) and their weighted sum under
    "loss". forecasts [B, T, H, L, E]; future_topk_ids [B, T, H, L, k] the router's top-k of
    token t+h; future_mask [B, T, H] True where token t+h exists in token t's sequence."""
    log_probs = forecasts.log_softmax(-1)
    nll = -log_probs.gather(-1, future_topk_ids.long()).mean(-1)  # [B, T, H, L]
    terms = {f"forecast_h{h}": _masked_mean(nll[:, :, h - 1], future_mask[:, :, h - 1])
             for h in range(1, len(weights) + 1)}
    terms["loss"] = sum(w * terms[f"forecast_h{h}"] for h, w in enumerate(weights, 1))
    return terms
