"""`prescient bench --memory`: decode tokens/s against a memory cap for the plain transformers
model, the same model memory-mapped, and the offloading runtime sized to the cap, each run a child
process under the cap (`cgroup.run_capped`); JSON rewritten after every run, and a PNG.

Order: the import floor, one uncapped plain run (the reference ids every run must equal), then per
cap `repeats` rounds of the systems interleaved (A B C A B C), the page cache dropped before each.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prescient.capped_run import HOW_COUNTED, CappedRun, cgroup_kind, drop_page_cache, run_capped
from experiments.bench_memory.plot import floor_bytes, plot_memory_curve
from experiments.bench_memory.systems import SYSTEMS
from prescient.errors import PrescientError

Runner = Callable[[list[str], "int | None", float], CappedRun]

METHOD = {
    "runs": "each run is a fresh `python -m experiments.bench_memory.child` process in a memory cgroup of its own "
            "capped at the cap; the page cache is dropped before it (sync; echo 1 > /proc/sys/vm/drop_caches) where "
            "allowed (page_cache_dropped), so every run reads its weights from disk under the cap",
    "order": "the import floor, one uncapped plain run (reference ids), then per cap `repeats` rounds of the systems "
             "in turn (A B C A B C)",
    "decoding": "greedy, up to new_tokens after the prompt, batch 1; a streamer notes each token: prefill to the "
                "first new token, tokens/s over the rest (decode only)",
    "exact": "a run is exact when its token ids equal the uncapped plain model's",
    "killed": "the kernel killed the run for want of memory under the cap (the cgroup's oom_kill count, or SIGKILL)",
    "refused": "the runtime refused the cap before loading (too small by its own account; the message names the "
               "smallest it takes)",
    "summary": "per cap and system: median and min-max of tokens/s over the runs that finished; killed runs counted",
    "ratios": "median tokens/s of prescient over plain and over mmap at the same cap (null where either did not "
              "run)",
    "floor": "a child that imports torch, transformers and the runtime and loads nothing, uncapped: peak_bytes is "
             "the cgroup's peak (page cache of the libraries read included, reclaimable under a cap), "
             "proc_status.VmHWM its peak RSS (anonymous + mapped libraries), the line on the plot",
    "runtime": "prescient's statistics over prefill and decode: hit rate, bytes moved and ms stalled on loads per "
               "new token",
}


class MemoryBenchError(PrescientError):
    """A memory curve that cannot be measured: bad sizes, no prompt, or a reference run that failed."""


def corpus_prompt(tokenizer, texts: list[str], tokens: int) -> str:
    """The first text with at least `tokens` tokens, cut to its first `tokens` tokens."""
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= tokens:
            return tokenizer.decode(ids[:tokens])
    raise MemoryBenchError(f"none of the {len(texts)} prompt texts has {tokens} tokens; give fewer --prompt-tokens")


def child_run(spec: dict[str, Any], cap: int | None, runner: Runner, timeout_s: float) -> dict[str, Any]:
    """One child under `cap`: the outcome (ok, killed, timeout, failed), the cgroup's account and
    the child's record."""
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as folder:
        spec_path, out_path = Path(folder) / "spec.json", Path(folder) / "out.json"
        spec_path.write_text(json.dumps({**spec, "memory": cap}))
        dropped = drop_page_cache()
        outcome = runner([sys.executable, "-m", "experiments.bench_memory.child", str(spec_path), str(out_path)],
                         cap, timeout_s)
        record = json.loads(out_path.read_text()) if outcome.returncode == 0 and out_path.exists() else {}
    status = ("killed" if outcome.killed else "timeout" if outcome.timed_out else "refused" if "refused" in record
              else "ok" if outcome.returncode == 0 and record else "failed")
    peak = outcome.peak_bytes if outcome.peak_bytes is not None else record.get("proc_status", {}).get("VmHWM")
    return {"system": spec["system"], "cap_bytes": cap, "status": status, "peak_bytes": peak,
            "page_cache_dropped": dropped, **record, "cgroup": outcome.to_dict()}


def _spread(values: list[float]) -> dict[str, float] | None:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else None


def summarize(runs: list[dict[str, Any]], caps: list[int], systems: tuple[str, ...]) -> list[dict[str, Any]]:
    """Per cap and system: runs, killed, exact, tokens/s median and spread, prefill, peak, bytes read
    from storage per decoded token, runtime."""
    out = []
    for cap in caps:
        for system in systems:
            mine = [r for r in runs if r["cap_bytes"] == cap and r["system"] == system]
            done = [r for r in mine if r["status"] == "ok"]
            entry = {"cap_bytes": cap, "system": system, "runs": len(mine),
                     **{s: sum(r["status"] == s for r in mine) for s in ("killed", "refused", "timeout", "failed")},
                     "exact": all(r.get("exact") for r in done) if done else None,
                     "tokens_per_s": _spread([r["tokens_per_s"] for r in done if r.get("tokens_per_s")]),
                     "prefill_seconds": _spread([r["prefill_seconds"] for r in done if r.get("prefill_seconds")]),
                     "peak_bytes": _spread([r["peak_bytes"] for r in mine if r.get("peak_bytes") is not None]),
                     "read_bytes_per_token": _spread([r["decode_read_bytes_per_token"] for r in done
                                                      if r.get("decode_read_bytes_per_token") is not None])}
            stats = [r["runtime"] for r in done if r.get("runtime")]
            if stats:
                entry["runtime"] = {k: statistics.median(s[k] for s in stats)
                                    for k in ("hit_rate", "bytes_moved_per_token", "stall_ms_per_token")}
            out.append(entry)
    return out


def ratios(summary: list[dict[str, Any]], caps: list[int]) -> list[dict[str, Any]]:
    """prescient's median tokens/s over plain's and over mmap's at each cap."""
    median = {(s["cap_bytes"], s["system"]): (s["tokens_per_s"] or {}).get("median") for s in summary}
    out = []
    for cap in caps:
        mine = median.get((cap, "prescient"))
        entry = {"cap_bytes": cap}
        for other in ("plain", "mmap"):
            theirs = median.get((cap, other))
            entry[f"prescient/{other}"] = mine / theirs if mine and theirs else None
        out.append(entry)
    return out


def plain_stops(summary: list[dict[str, Any]]) -> dict[str, int | None]:
    """The largest cap where a plain run was killed and the smallest where every plain run finished."""
    plain = [s for s in summary if s["system"] == "plain"]
    killed = [s["cap_bytes"] for s in plain if s["killed"]]
    running = [s["cap_bytes"] for s in plain if s["runs"] and s["tokens_per_s"] and not s["killed"]]
    return {"largest_killed_cap_bytes": max(killed, default=None),
            "smallest_running_cap_bytes": min(running, default=None)}


def _write(result: dict[str, Any], caps: list[int], json_path: str | Path) -> None:
    from prescient.atomic import write_json_atomic

    systems = tuple(result["settings"]["systems"])
    result["summary"] = summarize(result["runs"], caps, systems)
    result["ratios"] = ratios(result["summary"], caps)
    result["plain_stops"] = plain_stops(result["summary"])
    write_json_atomic(json_path, result)


def bench_memory(model_dir: str | Path, caps: list[int], prompt: str, *, json_path: str | Path,
                 plot_path: str | Path | None = None, new_tokens: int = 128, repeats: int = 3, threads: int = 1,
                 predictor: str | None = None, systems: tuple[str, ...] = SYSTEMS, timeout_s: float = 1800.0,
                 runner: Runner = run_capped) -> dict[str, Any]:
    """Measure the curve (see the module doc); the JSON is rewritten after every run, the PNG at
    the end. MemoryBenchError when the uncapped plain run, the reference, does not finish."""
    from experiments.machine import machine_info

    if not caps or any(cap <= 0 for cap in caps) or unknown(systems):
        raise MemoryBenchError(f"give at least one positive cap and systems among {', '.join(SYSTEMS)}")
    kind = cgroup_kind()
    spec = {"model": str(model_dir), "prompt": prompt, "new_tokens": new_tokens, "threads": threads,
            "predictor": predictor and str(predictor)}
    result: dict[str, Any] = {
        "what": "decode tokens/s against a memory cap: plain transformers, the model memory-mapped, prescient",
        "settings": {**spec, "caps_bytes": caps, "repeats": repeats, "systems": list(systems),
                     "timeout_s": timeout_s},
        "machine": machine_info(threads), "method": METHOD, "cgroup": kind, "how_counted": HOW_COUNTED[kind],
        "capped": kind != "none", "runs": []}
    result["floor"] = child_run({**spec, "system": "floor"}, None, runner, timeout_s)
    reference = child_run({**spec, "system": "plain"}, None, runner, timeout_s)
    if reference["status"] != "ok":
        raise MemoryBenchError(f"the uncapped plain run ended {reference['status']}: "
                               f"{reference['cgroup']['stderr_tail'][-400:]}")
    result["reference"] = {**reference, "exact": True}
    _write(result, caps, json_path)
    for cap in caps:
        for repeat in range(repeats):
            for system in systems:
                record = child_run({**spec, "system": system}, cap, runner, timeout_s)
                record["repeat"] = repeat
                if record["status"] == "ok":
                    record["exact"] = record["token_ids"] == reference["token_ids"]
                result["runs"].append(record)
                _write(result, caps, json_path)
    if plot_path:
        plot_memory_curve(result, plot_path)
    return result


def unknown(systems: tuple[str, ...]) -> list[str]:
    return [s for s in systems if s not in SYSTEMS] or ([] if systems else ["(none)"])


def summary_text(result: dict[str, Any]) -> str:
    """One line per cap and system: tokens/s median [min-max], killed runs, exactness; then the ratios."""
    lines = [f"memory curve of {result['settings']['model']} (cgroup {result['cgroup']}; floor "
             f"{floor_bytes(result) / 2**30:.2f} GiB RSS; plain uncapped "
             f"{result['reference'].get('tokens_per_s') or 0:.1f} tok/s)"]
    for s in result["summary"]:
        speed = s["tokens_per_s"]
        text = f"{speed['median']:.1f} tok/s [{speed['min']:.1f}-{speed['max']:.1f}]" if speed else "-"
        lines.append(f"  {s['cap_bytes'] / 2**30:6.2f} GiB  {s['system']:<9} {text:<26} killed {s['killed']}/"
                     f"{s['runs']}  refused {s['refused']}/{s['runs']}  exact {s['exact']}")
    for r in result["ratios"]:
        lines.append(f"  {r['cap_bytes'] / 2**30:6.2f} GiB  prescient/plain {r['prescient/plain']}  "
                     f"prescient/mmap {r['prescient/mmap']}")
    return "\n".join(lines)
