"""LightningModule that trains the hidden-state probe (`predictor.probe`) on a hidden-state trace.

For every (source layer l, offset a ≤ `ahead`) the probe reads layer l's block input and is
scored against the router of layer l + a. The loss is `predictor.losses.predictor_loss`, averaged
over tokens and pairs, with the probe's defaults (configs/predictor/probe.yaml):

    KL(router softmax ‖ probe softmax)   distillation over the router's logits (`tkd`, distance
                                         kl; the trace's top-T logits: every expert when T ≥ E)
  + mean_j∈top-k CE(probe, j)            the router's top-k *set*, what prefetching needs (`topk_ce`)

Zhu et al. train with a ranking-aware loss; distillation of the router's logits ranks too (it
matches the whole order the router's softmax encodes), and the top-k term weights the set.

Logged: train/{loss, tkd, topk_ce} every step; val/recall_at_k and val/recall_at_2k (one layer
ahead, over layers 1..L−1: the share of the router's top-k among the probe's top-k / top-2k) and,
for a ≥ 2, val/recall_at_k_a{a} every validation.
"""

from __future__ import annotations

from dataclasses import asdict

import lightning as L
import torch

from predictor.base import PredictorMeta
from predictor.losses import LossConfig, predictor_loss
from predictor.metrics import recall_at
from predictor.probe import ProbeHeads, ProbeLookahead
from prescient.errors import TraceError
from prescient.traces import read_manifest, require_hidden_states


class ProbeModule(L.LightningModule):
    def __init__(self, trace_dir: str, ahead: int = 1, hidden_dim: int = 256, loss: LossConfig | None = None,
                 lr: float = 2e-3, weight_decay: float = 0.01):
        """
        Args:
            trace_dir: hidden-state training trace (linked from data.trace_dir); gives the shapes and fingerprint.
            ahead: offsets 1..ahead: layer l's input predicts layers l+1..l+ahead.
            hidden_dim: width h of the probe's hidden layer.
            loss: loss terms and weights (`predictor.losses.LossConfig`).
            lr: AdamW learning rate.
            weight_decay: AdamW weight decay.
        """
        super().__init__()
        self.loss_config = LossConfig(**loss) if isinstance(loss, dict) else loss or LossConfig(
            ce_weight=0.0, distance="kl", topk_ce_weight=1.0)
        manifest = read_manifest(trace_dir)
        if manifest is None:
            raise TraceError(f"{trace_dir} is not a trace directory (no manifest); make one with `prescient trace "
                             "--hidden-states`")
        require_hidden_states(trace_dir, manifest)
        if manifest.settings.get("decoder_reads_row_token"):
            raise TraceError(f"trace {trace_dir} is of an encoder-decoder; the probe predicts within one stack of "
                             "a decoder-only model")
        self.fingerprint = manifest.fingerprint
        self.save_hyperparameters({"trace_dir": trace_dir, "ahead": ahead, "hidden_dim": hidden_dim,
                                   "loss": asdict(self.loss_config), "lr": lr, "weight_decay": weight_decay})
        fp = self.fingerprint
        self.hidden_size = manifest.hidden_size
        self.heads = ProbeHeads(fp.n_moe_layers, manifest.hidden_size, fp.n_experts, ahead, hidden_dim)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.heads(hidden)

    def _terms(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(logits [B, P, E], loss terms) with each pair scored against its target layer."""
        logits = self.heads(batch["hidden"])
        t = self.heads.targets
        mask = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
        terms = predictor_loss(logits, batch["topk_ids"][:, t], batch["topt_ids"][:, t], batch["topt_logits"][:, t],
                               mask, self.loss_config)
        return logits, terms

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        _, terms = self._terms(batch)
        self.log_dict({f"train/{name}": value for name, value in terms.items()}, batch_size=len(batch["hidden"]))
        return terms["loss"]

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        logits, terms = self._terms(batch)
        true = batch["topk_ids"][:, self.heads.targets]
        k, n = self.fingerprint.top_k, len(batch["hidden"])
        metrics = {f"val/{name}": value for name, value in terms.items()}
        offsets = self.heads.offsets()
        for a in range(1, self.heads.ahead + 1):
            pairs = offsets == a
            suffix = "" if a == 1 else f"_a{a}"
            metrics[f"val/recall_at_2k{suffix}"] = recall_at(logits[:, pairs], true[:, pairs], 2 * k)
            if a > 1:
                metrics[f"val/recall_at_k{suffix}"] = recall_at(logits[:, pairs], true[:, pairs], k)
        self.log_dict(metrics, batch_size=n, sync_dist=True)
        recall = recall_at(logits[:, offsets == 1], true[:, offsets == 1], k)
        self.log("val/recall_at_k", recall, batch_size=n, sync_dist=True, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.heads.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)

    def to_predictor(self, training: dict | None = None, metrics: dict[str, float] | None = None) -> ProbeLookahead:
        """The trained probe behind the predictor interface (unbound: `bind(model)` to run it), ready to save."""
        hparams = {"ahead": self.heads.ahead, "hidden_dim": self.hparams.hidden_dim, "hidden_size": self.hidden_size,
                   "activation": "silu"}
        meta = PredictorMeta(ProbeLookahead.kind, self.fingerprint, hparams, training or {}, metrics or {})
        return ProbeLookahead(self.heads.cpu(), meta)
