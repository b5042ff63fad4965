"""The PNG of `prescient bench-batch`: end-to-end throughput and bytes moved per generated token
of every schedule at each compared policy (medians, bars from the fastest to the slowest
repeat; the HRM's prediction for the schedule as a black dash where the JSON has one), Klotski's
group-size sweep with the planner's choice, and the HRM's predictions against CGOPipe's
measurements over the validation grid."""

from __future__ import annotations

from typing import Any

from prescient.atomic import write_atomic

COLOURS = {"klotski": "tab:green", "klotski-paper": "tab:olive", "cgopipe": "tab:blue", "zigzag": "tab:orange", "sequential": "tab:red",
           "accelerate": "tab:purple"}


def plot_bench_batch(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 + ("klotski_sweep" in result) + ("hrm" in result)
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.5))
    speed, moved = axes[0], axes[1]
    labels = list(result["by_policy"])
    modes = list(dict.fromkeys(m for row in result["by_policy"].values() for m in row["modes"]))
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        for ax, key, scale in ((speed, "tokens_per_s", 1), (moved, "bytes_per_token", 1e-6)):
            xs, mid, low, high, predicted = [], [], [], [], []
            for x, label in enumerate(labels):
                row = result["by_policy"][label]["modes"].get(mode, {})
                stat = row.get(key)
                if stat:
                    xs.append(x + (i - (len(modes) - 1) / 2) * width)
                    mid.append(stat["median"] * scale)
                    low.append((stat["median"] - stat["min"]) * scale)
                    high.append((stat["max"] - stat["median"]) * scale)
                    predicted.append(row.get(f"predicted_{key}"))
            ax.bar(xs, mid, width, yerr=[low, high], label=mode, color=COLOURS.get(mode), capsize=2)
            shown = [(x, y * scale) for x, y in zip(xs, predicted, strict=True) if y is not None]
            if shown:
                ax.scatter(*zip(*shown, strict=True), marker="_", s=200, color="black",
                           label="HRM" if i == 0 else None, zorder=3)
    for ax, title in ((speed, "tokens/s end to end (prefill included)"), (moved, "MB moved per generated token")):
        ax.set_xticks(range(len(labels)), labels, fontsize=8)
        ax.set_title(title)
    speed.legend(fontsize=8)
    panel = 2
    if "klotski_sweep" in result:
        sweep, ax = result["klotski_sweep"], axes[panel]
        ns = [int(n) for n in sweep["tokens_per_s_by_group_size"]]
        stats = list(sweep["tokens_per_s_by_group_size"].values())
        ax.errorbar(ns, [s["median"] for s in stats], yerr=[[s["median"] - s["min"] for s in stats],
                                                            [s["max"] - s["median"] for s in stats]], marker="o")
        ax.axvline(sweep["planner_group_size"], color="tab:green", linestyle="--", label="planner's n")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("group size n (micro-batches)")
        ax.set_ylabel("tokens/s end to end")
        ax.set_title(f"Klotski's planner: {sweep['planner_gap']:.1%} below the best n")
        ax.legend(fontsize=8)
        panel += 1
    if "hrm" in result:
        ax = axes[panel]
        grid = [r for r in result["runs"] if r["part"] == "grid"]
        # older results hold the decode prediction under "predicted_tokens_per_s"
        predicted = [r.get("predicted_decode_tokens_per_s", r["predicted_tokens_per_s"]) for r in grid]
        ax.scatter(predicted, [r["decode_tokens_per_s"] for r in grid])
        for r, x in zip(grid, predicted, strict=True):
            ax.annotate(r["label"], (x, r["decode_tokens_per_s"]), fontsize=7)
        ax.set_xlabel("HRM predicted decode tokens/s")
        ax.set_ylabel("measured decode tokens/s")
        ax.set_title(f"HRM vs CGOPipe: Spearman {result['hrm']['spearman']:.2f}, "
                     f"planner gap {result['hrm']['planner_gap']:.1%}")
    fig.tight_layout()
    write_atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120))
    plt.close(fig)
