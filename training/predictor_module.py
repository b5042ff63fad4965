"""LightningModule that trains SiDA's hash function on router traces with truncated KD.

It reads the trace manifest for the MoE shape and fingerprint (`trace_dir` is linked from
the data module by the CLI) and the target model's token embeddings from `model_dir`
(default: the model directory the trace manifest records under `settings["model"]`).

Logged: train/{loss, ce, tkd, ...} every step; val/{loss, ...}, val/recall_at_k (share of
the router's top-k experts among the predicted top-k, k = the model's top-k) and
val/recall_at_2k (among the predicted top-2k) every validation.

With forecast heads (`horizon` H > 0, needs the data module's `horizon` too: the CLI links it),
the loss adds `forecast_loss` with a weight per horizon (`loss.horizon_weights`), the terms
of the current token staying as they are; logged per horizon h: train/forecast_hh,
val/forecast_hh, val/recall_at_k_hh and val/recall_at_2k_hh (the router's top-k of token t+h
among the top-k / top-2k forecast after token t). The artifact records H in its hparams.

A non-finite loss stops training by raising `NonFiniteLossError` before the optimizer
step, on every DDP rank at once, so no checkpoint holding bad weights is ever written.
"""

from __future__ import annotations

from dataclasses import asdict

import lightning as L
import torch

from predictor.base import PredictorMeta
from predictor.losses import LossConfig, forecast_loss, predictor_loss
from predictor.metrics import recall_at
from predictor.sida import SiDAHash, SiDAPredictor, SiDASizes, read_token_embeddings
from prescient.errors import ModelFilesError, PrescientError, TraceError
from prescient.fingerprint import ModelFingerprint, fingerprint_model_dir
from prescient.traces import read_manifest


class NonFiniteLossError(PrescientError):
    """The training loss became NaN or infinite."""


def _require_traced_model(model_dir: str, trace_dir: str, traced: ModelFingerprint) -> None:
    """The model whose embeddings the hash function takes must be the traced one, by fingerprint
    (not by path: a model is the same wherever it lies, and another can share a vocabulary)."""
    fingerprint_model_dir(model_dir).require_same(traced, f"trace {trace_dir}")


class PredictorModule(L.LightningModule):
    def __init__(
        self,
        trace_dir: str,
        model_dir: str | None = None,
        sizes: SiDASizes | None = None,
        loss: LossConfig | None = None,
        lr: float = 2e-3,
        weight_decay: float = 0.01,
        horizon: int = 0,
    ):
        """
        Args:
            trace_dir: training trace (linked from data.trace_dir); gives the MoE shape and fingerprint.
            model_dir: the traced HF model directory, for its token embeddings; default: the trace's.
            sizes: hash-function sizes and variant (causal / bidirectional).
            loss: loss terms and weights.
            lr: AdamW learning rate.
            weight_decay: AdamW weight decay.
            horizon: forecast heads for tokens t+1..t+horizon after token t (0: none).
        """
        super().__init__()
        # dicts come back from a checkpoint's hyper-parameters (`load_from_checkpoint`)
        self.sizes = SiDASizes(**sizes) if isinstance(sizes, dict) else sizes or SiDASizes()
        self.loss_config = LossConfig(**loss) if isinstance(loss, dict) else loss or LossConfig()
        self.horizon_weights = self.loss_config.forecast_weights(horizon)  # checks one weight per horizon
        manifest = read_manifest(trace_dir)
        if manifest is None:
            raise TraceError(f"{trace_dir} is not a trace directory (no manifest); make one with `prescient trace`")
        self.fingerprint = manifest.fingerprint
        model_dir = model_dir or manifest.settings.get("model")
        if not model_dir:
            raise ModelFilesError(
                f"the trace {trace_dir} does not record its model directory; give --model.model_dir"
            )
        _require_traced_model(model_dir, trace_dir, self.fingerprint)
        embedding = read_token_embeddings(model_dir)
        if embedding.shape[0] < self.fingerprint.vocab_size:
            raise ModelFilesError(
                f"{model_dir} embeds {embedding.shape[0]} tokens but the trace's model has a vocabulary of "
                f"{self.fingerprint.vocab_size}; give the model directory the trace was made from"
            )
        self.save_hyperparameters(
            {"trace_dir": trace_dir, "model_dir": str(model_dir), "sizes": asdict(self.sizes),
             "loss": asdict(self.loss_config), "lr": lr, "weight_decay": weight_decay, "horizon": horizon}
        )
        fp = self.fingerprint
        self.hash = SiDAHash.from_embedding(embedding, fp.n_moe_layers, fp.n_experts, self.sizes, horizon)
        # every DDP rank reads the same frozen embedding: never broadcast it (it can be GBs)
        self._ddp_params_and_buffers_to_ignore = ["hash.token_proj.embedding"]

    def forward(self, token_ids: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        return self.hash(token_ids, lengths)

    @property
    def horizon(self) -> int:
        return self.hash.horizon

    def _terms(self, batch: dict[str, torch.Tensor]
               ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
        """(logits [B, T, L, E], forecasts [B, T, H, L, E] or None, loss terms)."""
        features = self.hash.features(batch["token_ids"], batch["mask"].sum(1))
        logits = self.hash.logits(features)
        terms = predictor_loss(
            logits, batch["topk_ids"], batch["topt_ids"], batch["topt_logits"], batch["mask"], self.loss_config
        )
        if not self.horizon:
            return logits, None, terms
        if "future_topk_ids" not in batch:
            raise TraceError(f"the model forecasts {self.horizon} tokens ahead but the batch holds no forecast "
                             f"targets; give the data module horizon={self.horizon} (the CLI links it)")
        forecasts = self.hash.forecasts(features)
        ahead = forecast_loss(forecasts, batch["future_topk_ids"], batch["future_mask"], self.horizon_weights)
        return logits, forecasts, {**terms, **ahead, "loss": terms["loss"] + ahead["loss"]}

    def _require_finite(self, loss: torch.Tensor) -> None:
        finite = bool(torch.isfinite(loss))
        if self.trainer.strategy.reduce_boolean_decision(finite, all=True):
            return
        callbacks = self.trainer.checkpoint_callbacks
        saved = sorted({p for cb in callbacks for p in (cb.best_model_path, cb.last_model_path) if p})
        raise NonFiniteLossError(
            f"the training loss became {loss.item()} at step {self.global_step}; training stopped before "
            f"the optimizer step. Good checkpoints: {', '.join(saved) or 'none written yet'}. Lower the learning "
            "rate (or check the trace for bad logits) and resume with --ckpt_path."
        )

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        _, _, terms = self._terms(batch)
        self._require_finite(terms["loss"])
        n_tokens = int(batch["mask"].sum())
        self.log_dict({f"train/{name}": value for name, value in terms.items()}, batch_size=n_tokens)
        return terms["loss"]

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        logits, forecasts, terms = self._terms(batch)
        mask, topk = batch["mask"], batch["topk_ids"]
        k = self.fingerprint.top_k
        n_tokens = int(mask.sum())
        metrics = {f"val/{name}": value for name, value in terms.items()}
        metrics["val/recall_at_2k"] = recall_at(logits, topk, 2 * k, mask)
        for h in range(1, self.horizon + 1):
            ahead, target, valid = (forecasts[:, :, h - 1], batch["future_topk_ids"][:, :, h - 1],
                                    batch["future_mask"][:, :, h - 1])
            metrics[f"val/recall_at_k_h{h}"] = recall_at(ahead, target, k, valid)
            metrics[f"val/recall_at_2k_h{h}"] = recall_at(ahead, target, 2 * k, valid)
        self.log_dict(metrics, batch_size=n_tokens, sync_dist=True)
        recall = recall_at(logits, topk, k, mask)
        self.log("val/recall_at_k", recall, batch_size=n_tokens, sync_dist=True, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.hash.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)

    def to_predictor(self, training: dict | None = None, metrics: dict[str, float] | None = None) -> SiDAPredictor:
        """The trained hash function behind the predictor interface, ready to save."""
        hparams = {**asdict(self.sizes), "horizon": self.horizon}
        meta = PredictorMeta(SiDAPredictor.kind, self.fingerprint, hparams, training or {}, metrics or {})
        return SiDAPredictor(self.hash, meta)
