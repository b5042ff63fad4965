"""The PNG of `prescient bench-batch`: throughputs at the main policy, and HRM's predictions
against the CGOPipe loop's measurements over the validation grid."""

from __future__ import annotations

from typing import Any

from prescient.atomic import write_atomic


def plot_bench_batch(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bars, scatter) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = ["all resident", "CGOPipe", "sequential"]
    values = [result["resident_tokens_per_s"], result["cgopipe_tokens_per_s"], result["sequential_tokens_per_s"]]
    bars.bar(names, values, color=["tab:gray", "tab:blue", "tab:orange"])
    for x, v in enumerate(values):
        bars.annotate(f"{v:.1f}", (x, v), ha="center", va="bottom")
    main = result["settings"]["main_policy"]
    bars.set_title(f"decode throughput, N={main['requests']} μ={main['micro_batch']} r_w={main['resident']:g}")
    bars.set_ylabel("tokens/s")
    grid = [r for r in result["runs"] if r["mode"] == "cgopipe" and r["label"] in result["settings"]["grid"]]
    scatter.scatter([r["predicted_tokens_per_s"] for r in grid], [r["tokens_per_s"] for r in grid])
    for r in grid:
        scatter.annotate(r["label"], (r["predicted_tokens_per_s"], r["tokens_per_s"]), fontsize=7)
    scatter.set_xlabel("HRM predicted tokens/s")
    scatter.set_ylabel("measured tokens/s")
    scatter.set_title(f"HRM vs CGOPipe: Spearman {result['spearman']:.2f}, planner gap {result['planner_gap']:.1%}")
    fig.tight_layout()
    write_atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120))
    plt.close(fig)
