"""The results page `reference-model`: the reference MoE the project trains, its recipes and its routing."""

from __future__ import annotations

from typing import Any

from experiments.report_pages.rows import CODE, DOCS
from experiments.report_tables import Page, Rows, Table, load, num, pct


def routing_rows(stats: dict[str, Any]) -> Rows:
    layers = range(stats["layers"])
    header = ["per MoE layer", *map(str, layers), "mean, layers 1–"]
    header[-1] += str(stats["layers"] - 1)
    summary = stats["summary"]
    rows = []
    for label, key, mean in (("gate-lookahead recall@k", "lookahead_recall", "lookahead_recall"),
                             ("per-token-id table recall@k", "token_table_recall", "token_table_recall"),
                             ("top-1 kept by the next token", "top1_repeat", "top1_repeat"),
                             ("the same by chance (same load)", "top1_repeat_chance", "top1_repeat_chance"),
                             ("router entropy / log E", "router_entropy_share", "router_entropy_share")):
        rows.append([label, *(num(v) for v in stats[key]), num(summary[mean], 3)])
    loads = [v for layer in stats["expert_load"] for v in layer]
    rows.append(["expert's share of its layer's load, min–max", *(f"{num(min(l), 3)}–{num(max(l), 3)}"
                                                                   for l in stats["expert_load"]),
                 f"{num(min(loads), 3)}–{num(max(loads), 3)}"])
    return header, rows


def page() -> Page:
    base = load("reference-base.json")

    def curve() -> Rows:
        return (["step", f"{CODE} (nats/token)", f"{DOCS} (nats/token)"],
                [[p["step"], num(p["val_loss"][CODE]), num(p["val_loss"][DOCS])] for p in base["val_curve"]])

    def recipes() -> Rows:
        rows = []
        for name in ("reference-base.json", "reference-tiny-demo.json", "reference-tiny.json"):
            r = load(name)
            m = r["recipe"]["model"] if "model" in r["recipe"] else {}
            imp = r.get("last_tenth_improvement")
            rows.append([f"`{name}`", r["size"], m.get("num_hidden_layers", "–"), m.get("hidden_size", "–"),
                         num(r["val_loss"][CODE], 3), num(r["val_loss"][DOCS], 3),
                         pct(imp[CODE], 2, signed=False) if imp else "–", num(r["train_seconds"], 0)])
        return (["JSON", "size", "layers", "hidden", f"{CODE} loss", f"{DOCS} loss",
                 "improvement over the last tenth of the steps", "training seconds"], rows)

    return Page("reference-model", "The reference model", """
Every measurement in this project runs on a reference MoE the project trains itself (no model hub is
reachable here): a Mixtral-architecture model with 8 MoE layers of 16 experts, top-2. Conclude that it
has learned (its validation loss fell from about 5 to under 3 nats per token and was still creeping
down at the end) and that it routes like a real MoE in the ways that matter to prefetching: the next
layer's router applied to this layer's input guesses most of the next layer's experts, a token's
identity alone guesses fewer, and load is balanced, so a cache has little skew to exploit. It is
smaller and flatter than a production MoE, which bounds how far its numbers carry.
""", (
        Table("Validation loss of the base recipe", ("reference-base.json",),
              "prescient reference-model --size bench --out runs/reference-bench", curve,
              note="`--size bench` trains the base recipe and widens it; this is the base model's own `reference.json`."),
        Table("The recipes tried", ("reference-base.json", "reference-tiny-demo.json", "reference-tiny.json"),
              "prescient reference-model --size base|tiny", recipes, note="`reference-tiny-demo.json` is the tiny recipe as the demo builds it."),
        Table("Routing of the base model on held-out stdlib-code", ("routing-base.json",),
              "prescient routing-stats --model runs/reference-bench-base --json results/routing-base.json "
              "--plot results/routing-base.png", lambda: routing_rows(load("routing-base.json")["statistics"]),
              note="Real MoEs, for comparison: gate lookahead 0.93–0.976 from hidden states (Zhu et al.; "
                   "DeepSeek-V2-Lite, Qwen3-30B-A3B, Phi-mini-MoE), about 0.97 from the previous layer's gate "
                   "input (Fate); Mixtral keeps its top-1 expert above chance at its middle and last layers."),
        Table("Routing of the base model on held-out stdlib-docs", ("routing-base-docs.json",),
              "prescient routing-stats --model runs/reference-bench-base --dataset stdlib-docs --json ...",
              lambda: routing_rows(load("routing-base-docs.json")["statistics"])),
    ))
