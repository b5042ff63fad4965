"""The PNG of `prescient routing-stats`: per-layer recall of gate lookahead and of the token
table, consecutive-token top-1 repeats against their chance, router entropy, expert load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the file-only backend)
from matplotlib.ticker import MaxNLocator  # noqa: E402

from prescient.atomic import write_atomic  # noqa: E402


def plot_routing(result: dict[str, Any], path: str | Path) -> Path:
    stats = result["statistics"]
    layers = range(stats["layers"])
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    ax = axes[0][0]
    look = stats["lookahead_recall"]
    ax.plot([l for l in layers if look[l] is not None], [v for v in look if v is not None], marker="o",
            label="gate lookahead (layer l+1's router on layer l's input)")
    ax.plot(layers, stats["token_table_recall"], marker="s", label="per-token-id table")
    ax.set_title("recall@k of the layer's experts")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8)
    ax = axes[0][1]
    ax.plot(layers, stats["top1_repeat"], marker="o", label="next token keeps the top-1 expert")
    ax.plot(layers, stats["top1_repeat_chance"], linestyle="--", label="chance (independent tokens, same load)")
    ax.set_title("consecutive tokens, same top-1 expert")
    ax.set_ylim(0, None)
    ax.legend(fontsize=8)
    ax = axes[1][0]
    ax.plot(layers, stats["router_entropy_share"], marker="o", label="router softmax")
    ax.plot(layers, stats["load_entropy_share"], marker="s", label="expert load")
    ax.set_title("entropy, share of log E")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8)
    ax = axes[1][1]
    image = ax.imshow(stats["expert_load"], aspect="auto", cmap="viridis")
    fig.colorbar(image, ax=ax, label="share of selections")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_title("expert load")
    for ax in axes.flat[:3]:
        ax.set_xlabel("MoE layer")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(f"routing of {Path(result['model']).name} on {result['dataset']}/{result['split']} "
                 f"({stats['tokens']} tokens)")
    fig.tight_layout()
    write_atomic(path, lambda p: fig.savefig(p, dpi=110, format="png"))
    plt.close(fig)
    return Path(path)
