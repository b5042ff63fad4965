"""`prescient routing-stats`: how a MoE model routes, measured as the field measures it
(training/routing_stats.py lists the statistics), on held-out text, with a plot.

JSON: {model, dataset, split, fit_split, seq_len, windows, statistics: {...}}.
"""

from __future__ import annotations

from pathlib import Path

import torch

from prescient.atomic import write_results
from prescient.errors import DatasetError
from prescient.loading import load_model, load_tokenizer
from training.corpora import load_corpus
from training.reference_lm import pack_windows
from training.routing_stats import routing_statistics


def _windows(tokenizer, dataset: str, split: str, text_field: str, seq_len: int, count: int) -> torch.Tensor:
    """Up to `count` packed windows of `seq_len` tokens from the split's first documents."""
    texts, chars = [], 0
    for text in load_corpus(dataset, split, text_field)["text"]:
        texts.append(text)
        chars += len(text)
        if chars >= 8 * seq_len * count:  # comfortably more characters than the tokens asked for
            break
    windows = pack_windows(tokenizer, texts, seq_len)[:count]
    if len(windows) == 0:
        raise DatasetError(f"dataset {dataset!r} split {split!r} holds fewer than {seq_len} tokens")
    return windows


def measure_routing(model_dir: str | Path, dataset: str, split: str = "validation", fit_split: str = "train",
                    text_field: str = "text", seq_len: int = 256, windows: int = 256, fit_windows: int = 1024,
                    batch_size: int = 16) -> dict:
    """The routing statistics of the model in `model_dir` over `windows` windows of `split`, its
    token table fit on `fit_windows` windows of `fit_split`."""
    model, _ = load_model(model_dir, dtype=torch.float32)
    tokenizer = load_tokenizer(model_dir)
    held_out = _windows(tokenizer, dataset, split, text_field, seq_len, windows)
    fit = _windows(tokenizer, dataset, fit_split, text_field, seq_len, fit_windows)
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
