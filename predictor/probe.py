"""A trained hidden-state probe per MoE layer, in the manner of the pre-attention predictor of
Zhu et al. (2025, arXiv 2511.10676: two linear layers on a layer's hidden state): from MoE layer
l's block input (the tensor `GateLookahead` reads), guess the router's choice at layers l+1..l+A.

    hidden [.., H] ─▶ Linear(H, h) ─▶ SiLU ─▶ Linear(h, E) ─▶ logits [.., E] of layer l + a

one such pair of layers for every (source layer l, offset a) with a ≤ A (`ahead`) and
l + a < L. Zhu et al. read the hidden state before the same layer's attention and predict that
layer's experts; we read the MoE block's input and predict the next A layers, which gives the
copy a lead of a layers' compute (`lookahead.HiddenLookahead`). The nonlinearity between the
two linear layers is ours (two linear layers alone compose into one). Weights are batched over
the pairs, [P, H, h] and [P, h, E], so training runs every pair in one einsum.

The probe needs hidden states, so it runs the live model: an artifact is loaded unbound, and
`bind(model)` (or `load_probe(path, model)`) attaches it to a model of its fingerprint. Trained
by `training.probe_module` from a trace made with `prescient trace --hidden-states`.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from predictor.artifact import load_predictor
from predictor.base import PredictorError, PredictorMeta, register_predictor
from predictor.lookahead import HiddenLookahead


class ProbeHeads(nn.Module):
    """Linear(H, h) → SiLU → Linear(h, E) for every (source layer, offset) pair, batched."""

    def __init__(self, n_layers: int, hidden_size: int, n_experts: int, ahead: int = 1, hidden_dim: int = 256):
        super().__init__()
        if not 1 <= ahead < max(n_layers, 2):
            raise PredictorError(f"ahead {ahead} must lie in 1..{n_layers - 1} (the model has {n_layers} MoE layers); "
                                 "set --model.ahead within it")
        self.ahead = ahead
        self.pairs = [(layer, a) for a in range(1, ahead + 1) for layer in range(n_layers - a)]
        self._index = {pair: i for i, pair in enumerate(self.pairs)}
        self.register_buffer("sources", torch.tensor([l for l, _ in self.pairs]), persistent=False)
        self.register_buffer("targets", torch.tensor([l + a for l, a in self.pairs]), persistent=False)
        p = len(self.pairs)
        self.w1 = nn.Parameter(torch.empty(p, hidden_size, hidden_dim))
        self.b1 = nn.Parameter(torch.empty(p, hidden_dim))
        self.w2 = nn.Parameter(torch.empty(p, hidden_dim, n_experts))
        self.b2 = nn.Parameter(torch.empty(p, n_experts))
        for weight, bias, fan_in in ((self.w1, self.b1, hidden_size), (self.w2, self.b2, hidden_dim)):
            bound = 1 / math.sqrt(fan_in)  # nn.Linear's default initialisation
            nn.init.uniform_(weight, -bound, bound)
            nn.init.uniform_(bias, -bound, bound)

    def offsets(self) -> torch.Tensor:
        """The offset a of each pair [P]."""
        return self.targets - self.sources

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, L, H] (every layer's block input) -> logits [B, P, E] of every pair's target."""
        x = hidden[:, self.sources].to(self.w1.dtype)
        z = F.silu(torch.einsum("bph,phd->bpd", x, self.w1) + self.b1)
        return torch.einsum("bpd,pde->bpe", z, self.w2) + self.b2

    def one(self, layer: int, ahead: int, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] of MoE layer `layer` -> logits [..., E] of layer `layer` + `ahead`."""
        i = self._index[(layer, ahead)]
        z = F.silu(hidden.to(self.w1.dtype) @ self.w1[i] + self.b1[i])
        return z @ self.w2[i] + self.b2[i]


@register_predictor
class ProbeLookahead(HiddenLookahead):
    kind = "probe"

    def __init__(self, heads: ProbeHeads, meta: PredictorMeta, model: nn.Module | None = None):
        super().__init__()
        self.heads, self.meta = heads.eval(), meta
        self.ahead = heads.ahead
        if model is not None:
            self.bind(model)

    def bind(self, model: nn.Module) -> "ProbeLookahead":
        super().bind(model)
        self.heads.to(next(model.parameters()).device)  # beside the hidden states it reads
        return self

    @property
    def max_ahead(self) -> int:
        return self.heads.ahead

    def ahead_hint(self, ahead: int) -> str:
        return f"; train one with --model.ahead {ahead}"

    def _lookahead(self, layer: int, hidden: torch.Tensor, ahead: int) -> torch.Tensor:
        with torch.no_grad():
            return self.heads.one(layer, ahead, hidden)

    def tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.heads.state_dict())

    @classmethod
    def from_artifact(cls, meta: PredictorMeta, tensors: dict[str, torch.Tensor]) -> "ProbeLookahead":
        fp, hp = meta.fingerprint, meta.hparams
        heads = ProbeHeads(fp.n_moe_layers, int(hp["hidden_size"]), fp.n_experts, int(hp["ahead"]),
                           int(hp["hidden_dim"]))
        heads.load_state_dict(tensors)
        return cls(heads, meta)


def load_probe(path: str | Path, model: nn.Module) -> ProbeLookahead:
    """The probe artifact at `path` (NAME, NAME.json or NAME.safetensors), bound to `model`; a probe
    trained on another model raises `FingerprintMismatchError` naming both."""
    probe = load_predictor(path)
    if not isinstance(probe, ProbeLookahead):
        raise PredictorError(f"{path} holds a {probe.kind!r} predictor, not a probe")
    return probe.bind(model)
