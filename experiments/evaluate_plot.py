"""The PNG of `prescient evaluate`: recall@k / recall@2k bars per predictor, recall@k per
layer, batch precision/recall against batch size, and the cross-dataset matrix if present."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the file-only backend)
from matplotlib.ticker import MaxNLocator  # noqa: E402

from prescient.atomic import write_atomic  # noqa: E402


def _bars(ax, predictors: dict[str, Any]) -> None:
    names = list(predictors)
    x = range(len(names))
    for offset, metric in ((-0.2, "recall_at_k"), (0.2, "recall_at_2k")):
        values = [predictors[n][metric] for n in names]
        bars = ax.bar([i + offset for i in x], values, width=0.4, label=metric.replace("_at_", "@"))
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(list(x), names, rotation=20)
    ax.set_ylim(0, 1.05)
    ax.set_title("recall per predictor")
    ax.legend(fontsize=8)


def _layers(ax, predictors: dict[str, Any]) -> None:
    for name, p in predictors.items():
        values = p["per_layer"]["recall_at_k"]
        ax.plot(range(len(values)), values, marker="o", label=name)
    ax.set_xlabel("MoE layer")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(0, 1.05)
    ax.set_title("recall@k per layer")
    ax.legend(fontsize=8)


def _batches(ax, predictors: dict[str, Any]) -> None:
    for i, (name, p) in enumerate(predictors.items()):
        sizes = [int(b) for b in p["batch"]]
        color = f"C{i}"
        ax.plot(sizes, [p["batch"][str(b)]["recall"] for b in sizes], marker="o", color=color, label=name)
        ax.plot(sizes, [p["batch"][str(b)]["precision"] for b in sizes], marker="x", ls="--", color=color)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.set_xlabel("sequences decoded together (B)")
    ax.set_ylim(0, 1.05)
    ax.set_title("batch set recall (—) / precision (--)")
    ax.legend(fontsize=8)


def _cross(ax, cross: dict[str, Any]) -> None:
    rows, cols = cross["train_datasets"], cross["datasets"]
    values = [[cross["predictor"]["recall_at_k"][r][c] for c in cols] for r in rows]
    image = ax.imshow(values, vmin=0, vmax=1, cmap="viridis")
    for i, row in enumerate(values):
        for j, v in enumerate(row):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", color="w" if v < 0.6 else "k")
    ax.set_xticks(range(len(cols)), cols)
    ax.set_yticks(range(len(rows)), rows)
    ax.set_xlabel("evaluated on")
    ax.set_ylabel("trained on")
    ax.set_title("cross-dataset recall@k")
    ax.figure.colorbar(image, ax=ax)


def plot_evaluation(result: dict[str, Any], path: str | Path) -> Path:
    """Draw every panel the result has data for and write the PNG atomically."""
    predictors = result.get("predictors", {})
    panels = []
    if predictors:
        panels += [lambda ax: _bars(ax, predictors), lambda ax: _layers(ax, predictors)]
        if result.get("batch_sizes"):
            panels.append(lambda ax: _batches(ax, predictors))
    if "cross_dataset" in result:
        panels.append(lambda ax: _cross(ax, result["cross_dataset"]))
    cols = min(len(panels), 2) or 1
    rows = max(-(-len(panels) // cols), 1)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4.2 * rows), squeeze=False)
    for i, ax in enumerate(axes.flat):
        if i < len(panels):
            panels[i](ax)
        else:
            ax.axis("off")
    if "trace" in result:
        t = result["trace"]
        fig.suptitle(f"{t['dataset']} / {t['split']} ({t['n_tokens']} tokens)", fontsize=10)
    fig.tight_layout()
    try:
        return write_atomic(path, lambda p: fig.savefig(p, format="png", dpi=110))
    finally:
        plt.close(fig)
