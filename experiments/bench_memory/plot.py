"""The memory curve's PNG: decode tokens/s against the memory cap, one curve per system (median,
min-max bars), killed runs as x and refused caps as hollow squares at the bottom, where the plain
model stops running shaded, the import floor as a vertical line and the uncapped plain model as a
horizontal one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the file-only backend)

from prescient.atomic import write_atomic  # noqa: E402

COLORS = {"plain": "black", "mmap": "tab:orange", "prescient": "tab:blue"}
KILLED_SIZE = {"plain": 15, "mmap": 11, "prescient": 7}  # x marks that share a cap stay visible
GIB = 2**30


def _curves(ax, summary: list[dict[str, Any]]) -> None:
    for system in dict.fromkeys(s["system"] for s in summary):
        mine = sorted((s for s in summary if s["system"] == system), key=lambda s: s["cap_bytes"])
        done = [s for s in mine if s["tokens_per_s"]]
        color = COLORS.get(system)
        if done:
            x = [s["cap_bytes"] / GIB for s in done]
            mid = [s["tokens_per_s"]["median"] for s in done]
            err = [[m - s["tokens_per_s"]["min"] for m, s in zip(mid, done)],
                   [s["tokens_per_s"]["max"] - m for m, s in zip(mid, done)]]
            inexact = " (not all exact)" if any(s["exact"] is False for s in done) else ""
            ax.errorbar(x, mid, yerr=err, marker="o", capsize=3, color=color, label=system + inexact)
        refused = [s["cap_bytes"] / GIB for s in mine if s.get("refused") and not s["tokens_per_s"]]
        if refused:
            ax.plot(refused, [0] * len(refused), "s", ms=8, mfc="none", mew=1.5, color=color, clip_on=False,
                    label=f"{system} refused the cap")
        killed = [s["cap_bytes"] / GIB for s in mine if s["killed"] and not s["tokens_per_s"]]
        if killed:
            ax.plot(killed, [0] * len(killed), "x", ms=KILLED_SIZE.get(system, 9), mew=2, color=color, clip_on=False,
                    label=f"{system} killed (out of memory)")


def floor_bytes(result: dict[str, Any]) -> int:
    """The import floor: the floor child's peak RSS, else its cgroup peak."""
    floor = result.get("floor", {})
    return floor.get("proc_status", {}).get("VmHWM") or floor.get("peak_bytes") or 0


def plot_memory_curve(result: dict[str, Any], path: str | Path) -> Path:
    """Draw the curve and write the PNG atomically."""
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    _curves(ax, result["summary"])
    floor = floor_bytes(result)
    if floor:
        ax.axvline(floor / GIB, color="gray", ls=":", label=f"import floor, RSS ({floor / GIB:.2f} GiB)")
    reference = result.get("reference", {}).get("tokens_per_s")
    if reference:
        ax.axhline(reference, color="black", ls="--", lw=1, alpha=0.5, label="plain, uncapped")
    stops = result.get("plain_stops", {})
    low, high = stops.get("largest_killed_cap_bytes"), stops.get("smallest_running_cap_bytes")
    if low and high and low < high:
        ax.axvspan(low / GIB, high / GIB, color="red", alpha=0.08, label="plain model stops running")
    elif low:
        ax.axvline(low / GIB, color="red", alpha=0.4, label="plain model killed at and below")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("memory cap (GiB)" + ("" if result.get("capped") else " — NOT capped: no writable cgroup"))
    ax.set_ylabel("decode tokens/s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    settings, machine = result["settings"], result["machine"]
    ax.set_title(f"{Path(settings['model']).name}: {settings['new_tokens']} new tokens, {settings['repeats']} "
                 f"repeats, {machine['torch_threads']} torch thread(s); "
                 + ("cgroup " + result["cgroup"] + ", page cache counted" if result.get("capped") else "uncapped"),
                 fontsize=9)
    fig.tight_layout()
    try:
        return write_atomic(path, lambda p: fig.savefig(p, format="png", dpi=110))
    finally:
        plt.close(fig)
