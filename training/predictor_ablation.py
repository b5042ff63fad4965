"""Ablation of the hash function's loss terms: train briefly with each variant on the same
trace and split, and record validation recall@k / recall@2k as JSON, next to the recall of
the table baselines (global frequency, per-token table) built from the same training split.

    prescient ablation TRACE runs/ablation.json [--model MODEL] [--max-steps 600] [--variants paper,bce]
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict

import lightning as L
import torch

from predictor.base import ExpertPredictor
from predictor.baselines import FrequencyPredictor, TokenTablePredictor
from predictor.losses import LossConfig
from predictor.metrics import recall_at
from predictor.sida import SiDASizes
from prescient.atomic import write_json_atomic
from prescient.traces import Trace
from training.predictor_data import PredictorDataModule, TraceWindows
from training.predictor_module import PredictorModule

log = logging.getLogger(__name__)

PAPER = {"ce_weight": 0.005, "tkd_weight": 1.0, "top_t": 30, "distance": "l1"}
VARIANTS: dict[str, dict] = {
    "paper": PAPER,  # SiDA: λ·CE(top-1) + TKD with L1 (at our learning rate, not the paper's 5e-5)
    "kl": {**PAPER, "distance": "kl"},  # TKD distance L1 → KL
    "ce1": {**PAPER, "ce_weight": 1.0},  # λ 0.005 → 1
    "bce": {**PAPER, "topk_bce_weight": 1.0},  # + multi-label BCE on the top-k set
    "topk_ce": {**PAPER, "topk_ce_weight": 1.0},  # + softmax CE on each of the top-k
    "kl+topk_ce": {**PAPER, "distance": "kl", "topk_ce_weight": 1.0},
    "topk_ce_only": {**PAPER, "ce_weight": 0.0, "tkd_weight": 0.0, "topk_ce_weight": 1.0},  # − CE − TKD
    "bce0.1": {**PAPER, "topk_bce_weight": 0.1},
    "topk_ce0.1": {**PAPER, "topk_ce_weight": 0.1},
}


class BestRecall(L.Callback):
    """Remembers the best val/recall_at_k (and the metrics with it) seen during training."""

    def __init__(self):
        self.best: dict[str, float] = {}

    def on_validation_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        metrics = {key: float(v) for key, v in trainer.callback_metrics.items() if key.startswith("val/")}
        if metrics.get("val/recall_at_k", -1.0) > self.best.get("val/recall_at_k", -1.0):
            self.best = {**metrics, "step": trainer.global_step}


def subset(trace: Trace, sequences: list[torch.Tensor]) -> Trace:
    rows = torch.cat(sequences)
    return Trace(trace.manifest, {name: column[rows] for name, column in trace.columns.items()})


def baseline_recall(pred: ExpertPredictor, windows: TraceWindows, k: int) -> dict[str, float]:
    batch = {name: torch.stack([windows[i][name] for i in range(len(windows))])
             for name in ("token_ids", "mask", "topk_ids")}
    scores = pred.predict(batch["token_ids"])
    return {name: float(recall_at(scores, batch["topk_ids"], n, batch["mask"]))
            for name, n in (("recall_at_k", k), ("recall_at_2k", 2 * k))}


def run_ablation(
    trace_dir: str,
    out: str,
    model_dir: str | None = None,
    val_trace_dir: str | None = None,
    variants: list[str] | None = None,
    max_steps: int = 600,
    val_every: int = 100,
    lr: float = 2e-3,
    sizes: SiDASizes | None = None,
    window: int = 128,
    batch_size: int = 64,
    seed: int = 0,
) -> dict:
    """Train each loss variant for `max_steps` and write its best validation metrics.

    Args:
        trace_dir: training trace.
        out: JSON file to write.
        model_dir: the traced model (default: the one the trace manifest records).
        val_trace_dir: validation trace (default: 10% of the training trace's sequences).
        variants: names from VARIANTS to run (default: all).
        max_steps: optimizer steps per variant.
        val_every: validate every this many steps; the best recall@k counts.
        lr: AdamW learning rate for every variant.
        sizes: hash-function sizes.
        window: tokens per training window.
        batch_size: windows per batch.
        seed: seed of the initialisation and data order.
    """
    sizes = sizes or SiDASizes()
    data = PredictorDataModule(trace_dir, val_trace_dir, window=window, batch_size=batch_size)
    data.setup("fit")
    train = subset(data.train_set.trace, [torch.arange(s, s + n) for s, n in data.train_set.spans])
    k = train.fingerprint.top_k
    results: dict = {"trace": data.describe(), "settings": {"max_steps": max_steps, "lr": lr, "sizes": asdict(sizes),
                                                         "window": window, "batch_size": batch_size, "seed": seed},
                     "baselines": {}, "variants": {}}
    for pred in (FrequencyPredictor.from_trace(train), TokenTablePredictor.from_trace(train)):
        results["baselines"][pred.kind] = baseline_recall(pred, data.val_set, k)
    for name in variants or list(VARIANTS):
        L.seed_everything(seed)
        loss = LossConfig(**VARIANTS[name])
        module = PredictorModule(trace_dir, model_dir, sizes, loss, lr)
        best = BestRecall()
        trainer = L.Trainer(max_steps=max_steps, val_check_interval=val_every, check_val_every_n_epoch=None,
                            logger=False, callbacks=[best], enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, num_sanity_val_steps=0)
        start = time.perf_counter()
        trainer.fit(module, datamodule=data)
        results["variants"][name] = {"loss": asdict(loss), "best": best.best,
                                     "seconds": round(time.perf_counter() - start, 1)}
        log.info("%s: %s", name, results["variants"][name])
        write_json_atomic(out, results)
    return results
