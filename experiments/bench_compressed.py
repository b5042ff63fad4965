"""`prescient bench-compressed`: decode speed of one model stored at several precisions (the
outputs of `prescient quantize`), interleaved with repeats, each beside its quality.

    prescient bench-compressed --models bf16=DIR,int8=DIR,int4=DIR,int4-packed=DIR --packed int4-packed \
        --budgets 12.5%,25%,50% --repeats 3 [--quality int8=Q.json,int4=Q.json] --json OUT.json --plot OUT.png

Each repeat runs `prescient bench` (`experiments.bench_runtime.bench_runtime`, every run in a
fresh process) on each model in turn — A B C A B C — with its all-resident baseline and on-demand
LRU at each budget, and with `predictor` (name, artifact, policy) that predictor's prefetching too. A budget is a share of the first model's slot bytes (all its experts in
slots), and every model gets those bytes: an expanded slot holds an expert in the compute dtype
(`options.dtype`) whatever its stored precision, so expanded models buy the same slots and differ
in what a miss costs (the bytes it moves and their expansion); the models named in `packed` keep
their experts compressed in their slots (`slot_format="packed"`: int4 in groups, int8 per
channel) and buy ~3.5x (~2x) the slots with the same bytes. Each run's record keeps the fraction of experts its bytes bought (`budget`) and the bytes
(`budget_bytes`); its label names the requested share. A `mixed` entry (NAME: coarse model, fine
model, rule; both packed models of `models`) runs the coarse model with the fine one's copies
beside it (`RuntimeOptions.fine_model`), `fine_share` of the same bytes in fine slots, each copy
chosen by the rule; with a predictor it runs only the predictor's runs, so every rule sees the
same prefetching. Mixed precision computes other weights than any one model: its runs' `exact`
(equal to the coarse model's tokens) is not expected, and its summary shows None.
Quality comes from `prescient quality` JSONs (perplexity increase, KL, top-1 agreement against
the uncompressed model, per dataset), copied beside each model's runs.

JSON: {settings, machine, models {NAME: {dir, slot_format, expert_bytes, slot_bytes, quality}}, runs [the
bench records, each with model and repeat], summary {NAME: {LABEL: {tokens_per_s median, range,
repeats, stall_ms_per_token, mb_moved_per_token, hit_rate, exact, vs_first_none_lru}}}, complete}.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import replace
from pathlib import Path
from statistics import mean, median
from typing import Any

from experiments.bench_runtime.bench import bench_runtime
from experiments.bench_runtime.grid import BenchError, RunSpec
from experiments.bench_runtime.records import not_exact, require_exact
from experiments.machine import machine_info
from offload_runtime.engine.options import RuntimeOptions
from offload_runtime.engine.store import ExpertStore
from prescient.atomic import write_json_atomic, write_results
from prescient.loading import load_without_experts

log = logging.getLogger(__name__)


def bench_compressed(models: dict[str, str], texts: list[str], budgets: list[float], repeats: int,
                     quality: dict[str, str], json_path: str | Path, plot_path: str | Path | None = None,
                     options: RuntimeOptions | None = None, packed: tuple[str, ...] = (),
                     predictor: tuple[str, str, str] | None = None,
                     mixed: dict[str, tuple[str, str, str]] | None = None, fine_share: float = 0.25,
                     modes: tuple[tuple[str, ...], ...] = ((),), **bench: Any) -> dict[str, Any]:
    """Interleaved repeats of each model's bench; the models named in `packed` keep their experts
    packed in slots; every run once per set of run modes in `modes` (`bench_runtime`'s `+look`,
    `+serial`, ...; `()`: none); `bench` passes on to `bench_runtime` (new_tokens, timed_prompts,
    sample_seed, threads, ...)."""
    options = options or RuntimeOptions(drop_page_cache=True)
    kinds = [("none", "lru")] + ([] if predictor is None else [(predictor[0], predictor[2])])
    predictors = {"none": None, **({} if predictor is None else {predictor[0]: predictor[1]})}
    unknown = sorted(set(packed) - set(models))
    if unknown:
        raise BenchError(f"--packed names {', '.join(unknown)}, which --models does not; name models of --models")
    placed = {name: replace(options, slot_format="packed" if name in packed else "expanded") for name in models}
    sizes = {name: _slot_sizes(path, placed[name]) for name, path in models.items()}
    mixed = mixed or {}
    for name, (coarse, fine, rule) in mixed.items():
        if not {coarse, fine} <= set(packed) or name in models:
            raise BenchError(f"--mixed {name}={coarse}+{fine}:{rule} needs two --packed models of --models "
                             "and a name of its own")
        if rule == "forecast" and predictor is None:
            raise BenchError(f"--mixed {name}: the forecast rule needs a --predictor with forecast heads")
        placed[name] = replace(placed[coarse], fine_model=models[fine], precision_rule=rule, fine_share=fine_share)
        sizes[name] = sizes[coarse]
    models = {**models, **{name: models[coarse] for name, (coarse, _, _) in mixed.items()}}
    first_bytes = math.prod(sizes[next(iter(models))])  # all of the first model's experts in slots
    result: dict[str, Any] = {
        "settings": {"budgets": budgets, "budgets_of": f"the slot bytes of all experts of {next(iter(models))}",
                     "repeats": repeats, "options": options.to_json(), "packed": list(packed),
                     "mixed": {name: list(entry) for name, entry in mixed.items()}, "fine_share": fine_share,
                     "predictor": list(predictor) if predictor else None,
                     "modes": ["+".join(mode) for mode in modes],
                     **{k: v for k, v in bench.items() if k != "threads"}},
        "machine": machine_info(bench.get("threads") or 1),
        "models": {name: {"dir": path, "slot_format": placed[name].slot_format, "fine_model": placed[name].fine_model,
                          "precision_rule": placed[name].precision_rule if name in mixed else None,
                          "quality": _quality(quality.get(name))}
                   for name, path in models.items()},
        "runs": [], "summary": {}, "complete": False,
    }
    for repeat in range(repeats):
        for name, path in models.items():
            log.info("repeat %d/%d: %s", repeat + 1, repeats, name)
            slot_bytes, experts = sizes[name]
            bought = {budget: min(experts, int(budget * first_bytes) // slot_bytes) for budget in budgets}
            own = kinds[1:] if name in mixed and predictor is not None else kinds
            asked = [RunSpec(kind, policy, budget, mode) for budget in budgets for kind, policy in own for mode in modes]
            runs = [RunSpec(spec.predictor, spec.policy, bought[spec.budget] / experts, spec.modes) for spec in asked]
            measured = bench_runtime(path, texts, predictors=predictors, runs=runs, baselines=("all_resident",),
                                     fail_if_not_exact=False,
                                     options=placed[name], **bench)
            model = measured["model"]
            result["models"][name].update(expert_bytes=model.get("expert_bytes"), slot_bytes=model.get("slot_bytes"))
            result["runs"].append({"model": name, "repeat": repeat, **measured["baselines"]["all_resident"]})
            for spec, record in zip(asked, measured["runs"]):
                result["runs"].append({"model": name, "repeat": repeat, **record, "label": spec.label,
                                       "budget_bytes": int(spec.budget * first_bytes)})
            result["summary"] = summarise(result["runs"], list(models), set(mixed))
            write_json_atomic(json_path, result)
    bad = not_exact([{**r, "label": f"{r['model']}:{r['label']}"} for r in result["runs"]
                     if r["label"] == "all_resident" or r["model"] not in mixed])
    result["complete"] = not bad  # kept for inspection, never complete with a run that is not exact
    write_results(result, json_path, plot_path, _plot)
    require_exact(bad, json_path)
    return result


def summarise(records: list[dict[str, Any]], names: list[str], mixed: set[str] = frozenset()) -> dict[str, Any]:
    """Per model and run label: medians over the repeats, the spread of tokens/s, and speed over
    the first model's (the uncompressed one's) on-demand LRU at the same budget (all-resident runs:
    over its all-resident run); `mixed` models' exactness is None (see the module doc)."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["model"], r["label"]), []).append(r)
    out: dict[str, Any] = {name: {} for name in names}
    for (name, label), rs in groups.items():
        speeds = [r["tokens_per_s"] for r in rs if r.get("tokens_per_s")]
        tokens = [r.get("decode_tokens") or 0 for r in rs]
        out[name][label] = {
            "tokens_per_s": median(speeds) if speeds else None,
            "tokens_per_s_range": [min(speeds), max(speeds)] if speeds else None, "repeats": len(rs),
            "stall_ms_per_token": _per_token([r.get("stall_seconds") for r in rs], tokens, 1e3),
            "mb_moved_per_token": _per_token([r.get("bytes_moved") for r in rs], tokens, 1e-6),
            "hit_rate": median([r["hit_rate"] for r in rs]) if all(r.get("hit_rate") is not None for r in rs) else None,
            "fine_share": (median(r["stats"]["fine_accesses"] / r["stats"]["accesses"] for r in rs)
                           if name in mixed and label != "all_resident"
                           and all(r.get("stats", {}).get("accesses") for r in rs) else None),
            "exact": None if name in mixed and label != "all_resident" else all(r.get("exact") for r in rs),
            "budget": rs[0].get("budget"),
        }
    first = names[0]
    for name in names:
        for label, row in out[name].items():
            lru = label if "@" not in label else RunSpec("none", "lru", float(label.split("@")[1].split("+")[0])).label
            base = out[first].get(lru, {}).get("tokens_per_s")
            row[f"vs_{first}"] = row["tokens_per_s"] / base if row["tokens_per_s"] and base else None
    return out


def _slot_sizes(path: str, options: RuntimeOptions) -> tuple[int, int]:
    """One slot's bytes for the model at `path` under `options`, and its number of experts."""
    model, layers = load_without_experts(path, dtype=options.torch_dtype)
    with ExpertStore(path, model, layers, slot_format=options.slot_format) as store:
        return store.expert_nbytes, store.num_layers * store.num_experts


def _per_token(values: list[float | None], tokens: list[int], unit: float) -> float | None:
    pairs = [(v, t) for v, t in zip(values, tokens) if v is not None and t]
    return median(v / t * unit for v, t in pairs) if pairs else None


def _quality(path: str | None) -> dict[str, Any] | None:
    """A `prescient quality` JSON's figures; a BenchError naming the file if it is not one."""
    if path is None:
        return None
    try:
        measured = json.loads(Path(path).read_text())
        return {"json": path, "reference": measured["reference"], "datasets": measured["datasets"]}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BenchError(f"--quality {path} is not a `prescient quality` JSON ({type(exc).__name__}: {exc}); "
                         "write one with prescient quality --json") from None


def _plot(result: dict[str, Any], path: str | Path) -> None:
    """Tokens/s against the mean next-token KL to the reference (mean over datasets; steadier than
    a perplexity difference on the same held-out tokens), a panel per budget (circles: on-demand
    LRU, squares: the predictor's runs); bars show the repeats' range. A mixed model's
    all-resident run is its coarse model's, so it is left out of the first panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = result["settings"]["budgets"]
    predictor = result["settings"].get("predictor")
    kinds = [("none", "lru", "o")] + ([(predictor[0], predictor[2], "s")] if predictor else [])
    panels = [("all resident", [("all_resident", "o")])] + [
        (f"{100 * b:g}% of the first model's slot bytes", [(RunSpec(k, p, b).label, m) for k, p, m in kinds])
        for b in budgets]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8))
    for ax, (title, labels) in zip(axes, panels):
        for index, (name, info) in enumerate(result["models"].items()):
            quality = info.get("quality")
            kl = mean(d["kl_nats"] for d in quality["datasets"].values()) if quality else 0.0
            for label, marker in labels:
                if label == "all_resident" and info.get("precision_rule"):
                    continue
                row = result["summary"].get(name, {}).get(label)
                if not row or row["tokens_per_s"] is None:
                    continue
                low, high = row["tokens_per_s_range"]
                ax.errorbar([kl], [row["tokens_per_s"]], yerr=[[row["tokens_per_s"] - low],
                                                                     [high - row["tokens_per_s"]]],
                            fmt=marker, color=f"C{index}", capsize=3, label=f"{name} {label.split('@')[0]}")
                ax.annotate(name, (kl, row["tokens_per_s"]), textcoords="offset points", xytext=(4, 4),
                            fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("next-token KL to the reference (nats)")
        ax.grid(alpha=0.3)
    for ax in axes:
        ax.set_ylim(bottom=0)
    axes[0].set_ylabel("decode tokens/s (median of repeats)")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
