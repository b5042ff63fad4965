"""Trace a model under real memory caps, beside its whole (resident) trace, as a user would run it.

Each run is a fresh `prescient trace` process: `resident` loads the whole model and runs uncapped
(its cgroup only measures it); a capped run passes `--memory CAP` and runs in a memory cgroup
capped at CAP (`prescient.capped_run`: anonymous memory and the page cache its reads bring in are
charged, clean pages reclaimed before the kernel kills). The page cache is dropped before every
run, so each reads its weights from disk. Order: per repeat, resident then every cap (A B C A B C).
The first resident trace is the reference: every other run's trace must equal it column for column
(token ids, expert ids, router logits) with the same manifest fingerprint and settings.

JSON: {what, command, machine, method, cgroup, how_counted, settings, expert_bytes, runs: [{kind,
cap_bytes, repeat, status, wall_s, peak_bytes, plan, configuration, load_average_before, routing_equal, cgroup}],
summary: {KIND: {runs, ok, killed, routing_equal, wall_s: {median, min, max}, wall_ratio_to_resident,
cap_over_experts, peak_bytes}}, load_average: {start, end}}.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from prescient.atomic import write_json_atomic
from prescient.capped_run import HOW_COUNTED, cgroup_kind, drop_page_cache, run_capped
from prescient.errors import PrescientError
from prescient.traces import load_trace

GB = 10**9


class TraceCappedError(PrescientError):
    """The resident trace, every run's reference, did not finish."""


@dataclass(frozen=True)
class TraceInputs:
    """What every run traces (the `prescient trace` flags)."""

    model: str
    dataset: str
    split: str
    max_tokens: int
    seq_len: int
    batch_size: int

    def argv(self, out: Path, cap: int | None) -> list[str]:
        memory = [] if cap is None else ["--memory", f"{cap}B"]
        return [sys.executable, "-m", "cli.main", "trace", "--model", self.model, "--dataset", self.dataset,
                "--split", self.split, "--max-tokens", str(self.max_tokens), "--seq-len", str(self.seq_len),
                "--batch-size", str(self.batch_size), *memory, "--out", str(out)]


def kind_name(cap: int | None) -> str:
    return "resident" if cap is None else f"memory {cap / GB:g}GB"


def same_routing(trace_dir: Path, reference_dir: Path) -> bool:
    """Every column equal and the same fingerprint and settings (what `prescient trace` records)."""
    a, b = load_trace(trace_dir), load_trace(reference_dir)
    return (a.columns.keys() == b.columns.keys() and all(torch.equal(a[c], b[c]) for c in a.columns)
            and a.manifest.fingerprint == b.manifest.fingerprint and a.manifest.settings == b.manifest.settings)


def logged(stderr: str, marker: str) -> str | None:
    """The last line of `stderr` that holds `marker`: the loader's plan ("memory ... GiB: ...") or the
    settings `prescient tune` measured on this machine ("configuration: ...")."""
    lines = [line.strip() for line in stderr.splitlines() if marker in line]
    return lines[-1] if lines else None


def one_run(inputs: TraceInputs, cap: int | None, out: Path, timeout_s: float) -> dict[str, Any]:
    """One trace process under `cap` (None: uncapped), the page cache dropped first."""
    load = round(os.getloadavg()[0], 2)
    dropped = drop_page_cache()
    outcome = run_capped(inputs.argv(out, cap), cap, timeout_s)
    status = ("killed" if outcome.killed else "timeout" if outcome.timed_out
              else "ok" if outcome.returncode == 0 else "failed")
    return {"kind": kind_name(cap), "cap_bytes": cap, "status": status, "wall_s": outcome.seconds,
            "peak_bytes": outcome.peak_bytes, "plan": logged(outcome.stderr_tail, " GiB: "),
            "configuration": logged(outcome.stderr_tail, "configuration: "), "page_cache_dropped": dropped,
            "load_average_before": load, "cgroup": outcome.to_dict()}


def _spread(values: list[float]) -> dict[str, float] | None:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else None


def summarize(runs: list[dict[str, Any]], expert_bytes: int) -> dict[str, Any]:
    """Per kind: how many ran, were killed, traced the reference's routing, wall and peak."""
    summary: dict[str, Any] = {}
    for kind in dict.fromkeys(r["kind"] for r in runs):
        mine = [r for r in runs if r["kind"] == kind]
        ok = [r for r in mine if r["status"] == "ok"]
        cap = mine[0]["cap_bytes"]
        summary[kind] = {"runs": len(mine), "ok": len(ok), "killed": sum(r["status"] == "killed" for r in mine),
                         "routing_equal": all(r.get("routing_equal") for r in ok) if ok else None,
                         "wall_s": _spread([r["wall_s"] for r in ok]),
                         "peak_bytes": _spread([r["peak_bytes"] for r in mine if r["peak_bytes"] is not None]),
                         "experts_over_cap": None if cap is None else round(expert_bytes / cap, 3)}
    resident = (summary.get("resident") or {}).get("wall_s")
    for entry in summary.values():
        entry["wall_ratio_to_resident"] = (round(entry["wall_s"]["median"] / resident["median"], 3)
                                           if entry["wall_s"] and resident else None)
    return summary


def expert_bytes_of(model: str) -> int:
    """The routed experts' bytes in float32 (what `trace` computes in), from the model's shapes."""
    from prescient.arch import find_moe_layers
    from prescient.fingerprint import expert_tensor_names
    from prescient.model_dir import ModelDirectory

    skeleton = ModelDirectory.of(model).weightless_model(torch.float32)
    names = expert_tensor_names(find_moe_layers(skeleton))
    return sum(t.numel() * t.element_size() for name, t in skeleton.state_dict().items() if name in names)


def trace_capped(inputs: TraceInputs, caps: list[int], json_path: str | Path, repeats: int = 3,
                 timeout_s: float = 600.0) -> dict[str, Any]:
    """Run and compare (see the module doc); the JSON is rewritten after every run."""
    from experiments.machine import machine_info

    kind = cgroup_kind()
    expert_bytes = expert_bytes_of(inputs.model)
    result: dict[str, Any] = {
        "what": f"prescient trace of {inputs.model} ({expert_bytes / GB:.3f} GB of float32 experts) whole and "
                "uncapped (resident) and with --memory CAP in a memory cgroup capped at CAP, interleaved, each a "
                "fresh process, the page cache dropped before each; wall: the whole command, load included",
        "command": "prescient trace --model {model} --dataset {dataset} --split {split} --max-tokens {max_tokens} "
                   "--seq-len {seq_len} --batch-size {batch_size} [--memory CAP] --out DIR".format(**asdict(inputs)),
        "machine": {**machine_info(1), "omp_num_threads": os.environ.get("OMP_NUM_THREADS")},
        "method": __doc__, "cgroup": kind, "how_counted": HOW_COUNTED[kind], "capped": kind != "none",
        "settings": {**asdict(inputs), "caps_bytes": caps, "repeats": repeats, "timeout_s": timeout_s},
        "expert_bytes": expert_bytes, "load_average": {"start": round(os.getloadavg()[0], 2)}, "runs": []}
    with tempfile.TemporaryDirectory(prefix="trace-capped-") as folder:
        reference = Path(folder) / "reference"
        for repeat in range(repeats):
            for cap in [None, *caps]:
                out = reference if repeat == 0 and cap is None else Path(folder) / "trace"
                record = {**one_run(inputs, cap, out, timeout_s), "repeat": repeat}
                if out == reference and record["status"] != "ok":
                    raise TraceCappedError(f"the resident trace, the reference, ended {record['status']}: "
                                           f"{record['cgroup']['stderr_tail'][-300:]}")
                if record["status"] == "ok":
                    record["routing_equal"] = same_routing(out, reference)
                if out != reference:
                    shutil.rmtree(out, ignore_errors=True)
                result["runs"].append(record)
                result["summary"] = summarize(result["runs"], expert_bytes)
                result["load_average"]["end"] = round(os.getloadavg()[0], 2)
                write_json_atomic(json_path, result)
    return result
