"""`prescient routing-stats`: how a MoE model routes, measured as the field measures it
(training/routing_stats.py lists the statistics), on held-out text, with a plot.

JSON: {model, dataset, split, fit_split, seq_len, windows, statistics: {...}}.
"""

from __future__ import annotations

from pathlib import Path

import torch

from prescient.atomic import write_results
from prescient.loading import load_model, load_tokenizer
from training.reference_lm import corpus_windows
from training.routing_stats import routing_statistics


def measure_routing(model_dir: str | Path, dataset: str, split: str = "validation", fit_split: str = "train",
                    text_field: str = "text", seq_len: int = 256, windows: int = 256, fit_windows: int = 1024,
                    batch_size: int = 16) -> dict:
    """The routing statistics of the model in `model_dir` over `windows` windows of `split`, its
    token table fit on `fit_windows` windows of `fit_split`."""
    model, _ = load_model(model_dir, dtype=torch.float32)
    tokenizer = load_tokenizer(model_dir)
    held_out = corpus_windows(tokenizer, dataset, split, text_field, seq_len, windows)
    fit = corpus_windows(tokenizer, dataset, fit_split, text_field, seq_len, fit_windows)
    return {
        "model": str(model_dir), "dataset": dataset, "split": split, "fit_split": fit_split,
        "seq_len": seq_len, "windows": len(held_out), "fit_windows": len(fit),
        "statistics": routing_statistics(model, fit, held_out, batch_size=batch_size),
    }


def run_routing_stats(json_path: str | Path, plot_path: str | Path | None = None, **kwargs) -> dict:
    from experiments.routing_stats_plot import plot_routing

    result = measure_routing(**kwargs)
    write_results(result, json_path, plot_path, plot_routing)
    return result
