"""The PNG of `prescient bench`: decode tokens/s, decode hit rate, time stalled on loads per
decode token and peak RSS against the expert budget, one line per predictor+policy, the
baselines as horizontal lines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the file-only backend)

from prescient.atomic import write_atomic  # noqa: E402

PANELS = (("tokens_per_s", "decode tokens/s"), ("hit_rate", "decode hit rate"),
          ("stall_ms_per_token", "stalled on loads (ms per decode token)"), ("peak_rss_mb", "peak RSS (MiB)"))


STYLES = {"lru": "-", "mrs": "--", "lfu": ":", "fifo": (0, (5, 1, 1, 1))}  # line style per policy


def _value(record: dict[str, Any], metric: str) -> float | None:
    if metric == "stall_ms_per_token":
        stall, tokens = record.get("stall_seconds"), record.get("decode_tokens")
        return 1000 * stall / tokens if stall is not None and tokens else None
    return record.get(metric)


def _lines(ax, runs: list[dict[str, Any]], metric: str) -> None:
    """One line per predictor+policy: colour by predictor, style by policy."""
    colors = {p: f"C{i % 10}" for i, p in enumerate(dict.fromkeys(r["predictor"] for r in runs))}
    for predictor, policy in dict.fromkeys((r["predictor"], r["policy"]) for r in runs):
        mine = [(r["budget"], _value(r, metric)) for r in runs if (r["predictor"], r["policy"]) == (predictor, policy)]
        points = sorted((budget, value) for budget, value in mine if value is not None)
        if points:
            ax.plot(*zip(*points), marker="o", ls=STYLES.get(policy, "-."), color=colors[predictor],
                    label=f"{predictor}+{policy}")


def _baselines(ax, baselines: dict[str, dict[str, Any]], metric: str) -> None:
    for name, color in (("all_resident", "black"), ("accelerate_disk", "gray")):
        value = baselines.get(name, {}).get(metric)
        if value is not None:
            ax.axhline(value, color=color, lw=2.5, alpha=0.5, label=name)


def plot_bench(result: dict[str, Any], path: str | Path) -> Path:
    """Draw the panels and write the PNG atomically."""
    runs = [r for r in result["runs"] if r.get("tokens_per_s") is not None]
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5.5 * len(PANELS), 4.6), squeeze=False)
    budgets = sorted({r["budget"] for r in runs})
    for ax, (metric, title) in zip(axes.flat, PANELS):
        _lines(ax, runs, metric)
        if metric in ("tokens_per_s", "peak_rss_mb"):
            _baselines(ax, result["baselines"], metric)
        if metric == "tokens_per_s" and any(r["tokens_per_s"] for r in runs):
            ax.set_yscale("log")
        ax.set_xticks(budgets, [f"{b:.0%}" for b in budgets])
        ax.set_xlabel("expert budget (share of all experts in memory)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7, ncol=2)
    machine, settings = result["machine"], result["settings"]
    seed = settings.get("sample_seed")
    decoding = "greedy" if seed is None else f"sampled (seed {seed})"
    fig.suptitle(f"{Path(result['model']['dir']).name}: {settings['timed_prompts']} prompts x "
                 f"{settings['new_tokens']} new tokens, {decoding}, {machine['torch_threads']} torch threads, "
                 f"store {settings['store']}{' (page cache dropped)' if settings['drop_page_cache'] else ''}",
                 fontsize=10)
    fig.tight_layout()
    try:
        return write_atomic(path, lambda p: fig.savefig(p, format="png", dpi=110))
    finally:
        plt.close(fig)
