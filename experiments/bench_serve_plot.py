"""The plot of `bench_serve`: throughput, latency and time to first token against concurrent
clients, one line per predictor setting (median over repeats, bars from the lowest to the highest)."""

from __future__ import annotations

from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from prescient.atomic import atomic_path  # noqa: E402


def plot_bench_serve(result: dict[str, Any], path: str) -> None:
    s = result["settings"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = [("tokens_per_s", "aggregate tokens/s"), ("latency_s", "request latency p50 / p99 (s)"),
              ("ttft_s", "time to first token p50 / p99 (s)")]
    for name in s["predictors"]:
        runs = [r for r in result["runs"] if r["predictor"] == name]
        clients = sorted({r["clients"] for r in runs})
        for ax, (key, title) in zip(axes, panels):
            for q, style in ((None, "-o"),) if key == "tokens_per_s" else (("p50", "-o"), ("p99", ":x")):
                values = [[r[key] if q is None else r[key][q] for r in runs if r["clients"] == c] for c in clients]
                values = [[v for v in vs if v is not None] or [float("nan")] for vs in values]
                mid = [sorted(vs)[len(vs) // 2] for vs in values]
                err = [[m - min(vs) for m, vs in zip(mid, values)], [max(vs) - m for m, vs in zip(mid, values)]]
                label = name if q is None else f"{name} {q}"
                ax.errorbar(clients, mid, yerr=err, fmt=style, capsize=3, label=label)
            ax.set_xscale("log", base=2)
            ax.set_xticks(clients, [str(c) for c in clients])
            ax.set_xlabel("concurrent clients")
            ax.set_title(title)
            ax.grid(alpha=0.3)
    axes[0].legend()
    axes[1].legend(fontsize=8)
    fig.suptitle(f"prescient serve: {s['model']}, {s['policy']} at budget {s['budget']}, {s['max_tokens']} tokens "
                 f"per request, {s['repeats']} repeats (median, min-max)", fontsize=10)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
