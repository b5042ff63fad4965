"""An untrained hidden-state probe for a model directory, saved as an artifact (for tests that
need a probe artifact but not a trained one)."""

from __future__ import annotations

from pathlib import Path

import torch

from predictor import PredictorMeta, ProbeLookahead, save_predictor
from predictor.probe import ProbeHeads
from prescient.fingerprint import fingerprint_model
from prescient.loading import load_model


def random_probe(model_dir: Path, out: Path, ahead: int = 1, hidden_dim: int = 8) -> Path:
    model, layers = load_model(model_dir, dtype=torch.float32)
    fingerprint, hidden_size = fingerprint_model(model, layers), model.config.hidden_size
    torch.manual_seed(0)
    heads = ProbeHeads(len(layers), hidden_size, fingerprint.n_experts, ahead, hidden_dim)
    hparams = {"ahead": ahead, "hidden_dim": hidden_dim, "hidden_size": hidden_size, "activation": "silu"}
    return save_predictor(ProbeLookahead(heads, PredictorMeta(ProbeLookahead.kind, fingerprint, hparams)), out)
