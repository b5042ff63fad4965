"""The JSON records of `prescient bench`: a run's record, the ratios between runs at the headline
budget, and the summary printed at the end."""

from __future__ import annotations

import logging
from statistics import median
from typing import Any

from experiments.bench_runtime.grid import BASELINES, RunSpec
from experiments.bench_runtime.load import Job
from experiments.bench_runtime.measure import Executor
from prescient.errors import PrescientError

log = logging.getLogger(__name__)


def _head(spec: RunSpec | None, kind: str) -> dict[str, Any]:
    head: dict[str, Any] = {"label": spec.label if spec else kind, "kind": kind}
    if spec is not None:
        head.update(predictor=spec.predictor, policy=spec.policy, budget=spec.budget, modes=list(spec.modes))
    return head


def record_of(spec: RunSpec | None, kind: str, result: dict[str, Any],
              reference: list[list[int]]) -> dict[str, Any]:
    """A job's JSON record: the spec, the headline numbers, exactness, then all it measured."""
    ids = result.pop("token_ids")
    stats = result.get("stats") or {}
    return {**_head(spec, kind), "tokens_per_s": result.pop("tokens_per_s"),
            "peak_rss_mb": result.pop("peak_rss_mb"), "hit_rate": stats.get("hit_rate"),
            "stall_seconds": stats.get("stall_seconds"), "bytes_moved": stats.get("bytes_moved"),
            "late_tables": stats.get("late_tables"),
            "exact": len(ids) > 0 and all(run == ref[: len(run)] for run, ref in zip(ids, reference)), **result}


def record_run(execute: Executor, job: Job, spec: RunSpec | None, reference: list[list[int]]) -> dict[str, Any]:
    """Execute one job and return its record; a failed job (e.g. out of memory) is recorded with
    its error, and the benchmark goes on."""
    options = {"options": job.options.to_json()} if job.kind == "offloaded" else {}
    try:
        return {**record_of(spec, job.kind, execute(job), reference), **options}
    except Exception as exc:
        log.error("run %s failed: %r", _head(spec, job.kind)["label"], exc)
        return {**_head(spec, job.kind), "tokens_per_s": None, "peak_rss_mb": None, "exact": False,
                "error": f"{type(exc).__name__}: {exc}", **options}


class NotExactError(PrescientError):
    """A benchmark run generated other tokens than the all-resident model of the same dtype, or failed."""


def not_exact(records: list[dict[str, Any]]) -> list[str]:
    """The labels of the records that failed or were not exact (a None `exact`: not comparable)."""
    return [r["label"] for r in records if r.get("exact") is False]


def require_exact(bad: list[str], json_path: object) -> None:
    """Fail loudly, naming the runs, when any run failed or was not exact."""
    if bad:
        raise NotExactError(f"{len(bad)} run(s) failed or generated other tokens than the all-resident model: "
                            f"{', '.join(bad)}; their records are in {json_path}, marked incomplete")


def ratios(runs: list[dict[str, Any]], baselines: dict[str, dict[str, Any]], budget: float) -> dict[str, Any]:
    """Each run at `budget` (the median over its repeats, with their range): its tokens/s over
    none+lru's median at that budget, and over each baseline's (null where a side is missing)."""
    speeds: dict[str, list[float]] = {}
    for r in runs:
        if r.get("budget") == budget and r.get("tokens_per_s"):
            speeds.setdefault(r["label"], []).append(r["tokens_per_s"])
    none_lru = speeds.get(RunSpec("none", "lru", budget).label)
    sides = {"vs_none_lru": median(none_lru) if none_lru else None,
             **{f"vs_{name}": baselines.get(name, {}).get("tokens_per_s") for name in BASELINES}}
    return {label: {"tokens_per_s": median(values), "repeats": len(values),
                    "tokens_per_s_range": [min(values), max(values)],
                    **{key: median(values) / side if side else None for key, side in sides.items()}}
            for label, values in speeds.items()}


def summary(result: dict[str, Any]) -> str:
    """One line per run and baseline: tokens/s, hit rate, peak RSS, exactness."""
    rows = [*result["baselines"].values(), *result["runs"]]
    lines = [f"{'run':<24} {'tokens/s':>9} {'simulated':>9} {'hit rate':>9} {'peak MiB':>9}  exact"]
    for r in rows:
        speed = f"{r['tokens_per_s']:.2f}" if r.get("tokens_per_s") else "-"
        simulated = f"{r['simulated']['tokens_per_s']:.2f}" if r.get("simulated") else "-"
        hit = f"{r['hit_rate']:.1%}" if r.get("hit_rate") is not None else "-"
        peak = f"{r['peak_rss_mb']:.0f}" if r.get("peak_rss_mb") else "-"
        error = f"  {r['error']}" if "error" in r else ""
        lines.append(f"{r['label']:<24} {speed:>9} {simulated:>9} {hit:>9} {peak:>9}  {r['exact']}{error}")
    agree = (result.get("simulator") or {}).get("agreement")
    if agree:
        lines.append(f"simulator vs measured median tokens/s: Spearman {agree['spearman']}, "
                     f"median relative error {agree['median_relative_error']}")
    cost = result.get("hash_thread_cost")
    if cost and cost.get("tokens_per_s_ratio"):
        lines.append(f"hash thread ({cost['predictor']}, tables ignored) / no thread at budget 1.0: "
                     f"{cost['tokens_per_s_ratio']:.3f}x decode tokens/s")
    return "\n".join(lines)
