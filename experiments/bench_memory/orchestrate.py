"""`prescient bench --memory`: decode tokens/s against a memory cap for the plain transformers
model, the same model memory-mapped, and the offloading runtime sized to the cap without a
predictor, with it, and with an oracle that knows the true routing (`systems`), over a set of
prompts, each run a child process under the cap (`cgroup.run_capped`); JSON rewritten after every
run, and a PNG.

Order: the import floor, one uncapped plain run per prompt (the reference ids every run must equal;
it also traces its own sequence for the oracle), one uncapped untimed run of each of the runtime's
systems (its compiled kernels built before the first timed run, not in it), then per cap `repeats` rounds of every prompt's
systems interleaved, their order rotated from one prompt and round to the next (A B C, B C A, C A B:
no system always follows the same one, whose reads may leave the storage below the page cache warm),
the page cache dropped before each.
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
from experiments.bench_memory.systems import RUNTIME_SYSTEMS, SYSTEMS, WITH_PREDICTOR
from prescient.errors import PrescientError

Runner = Callable[[list[str], "int | None", float], CappedRun]

METHOD = {
    "runs": "each run is a fresh `python -m experiments.bench_memory.child` process in a memory cgroup of its own "
            "capped at the cap; the page cache is dropped before it (sync; echo 1 > /proc/sys/vm/drop_caches) where "
            "allowed (page_cache_dropped), so every run reads its weights from disk under the cap",
    "order": "the import floor, one uncapped plain run per prompt (reference ids, and the oracle's trace), one "
             "uncapped untimed run of each runtime system on the first prompt (warmups: numba caches its compiled "
             "kernels per source path, so a new checkout's first run would compile them under the cap), then per "
             "cap `repeats` rounds of every prompt's systems in turn, the order rotated by one from one prompt and "
             "round to the next (A B C, B C A, C A B: `rotated`), so no system always runs after the same one",
    "prompts": "the first texts of the corpus's held-out split with at least prompt_tokens tokens, cut to that many",
    "per_prompt": "per cap, prompt and system: median tokens/s over the repeats and their range; ratios of each "
                  "runtime system over no-predictor per prompt (of the medians, and per repeat: paired), and their "
                  "median over the prompts (the paired statistic)",
    "decoding": "greedy, up to new_tokens after the prompt, batch 1; a streamer notes each token: prefill to the "
                "first new token, tokens/s over the rest (decode only)",
    "exact": "a run is exact when its token ids equal the uncapped plain model's (llama.cpp, whose ids are not "
             "ours: when its text and the plain model's decoded text are the same as far as both go; text_equal: "
             "the same whole)",
    "llama.cpp": "llama-completion greedy on a GGUF of the model, memory-mapped, run from the child process (the same "
                 "cgroup and cap); tokens/s from its 'eval time = X ms / N runs' line (decode only), bytes read per "
                 "token from its /proc/<pid>/io read_bytes between its first and last printed token, over N",
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


def corpus_prompts(tokenizer, texts: list[str], tokens: int, count: int = 1) -> list[str]:
    """The first `count` texts with at least `tokens` tokens, each cut to its first `tokens` tokens."""
    prompts = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= tokens:
            prompts.append(tokenizer.decode(ids[:tokens]))
            if len(prompts) == count:
                return prompts
    raise MemoryBenchError(f"{len(prompts)} of the {len(texts)} prompt texts have {tokens} tokens, {count} asked for; "
                           "give fewer --prompts or --prompt-tokens")


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


RUNTIME_FIELDS = ("hit_rate", "bytes_moved_per_token", "stall_ms_per_token", "loads_per_token", "wasted_bytes_per_token",
                  "tables_on_time")
PROCESS_FIELDS = ("RssAnon", "RssFile")


def summarize(runs: list[dict[str, Any]], caps: list[int], systems: tuple[str, ...]) -> list[dict[str, Any]]:
    """Per cap and system, over every prompt's runs: runs, killed, exact, tokens/s median and spread,
    prefill, peak, major faults and bytes read from storage per decoded token, the process's
    anonymous and file-backed memory at its end, the runtime's counters."""
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
                                                      if r.get("decode_read_bytes_per_token") is not None]),
                     "major_faults_per_token": _spread([r["decode_major_faults_per_token"] for r in done
                                                        if r.get("decode_major_faults_per_token") is not None]),
                     **{f: _spread([r["proc_status"][f] for r in done if f in r.get("proc_status", {})])
                        for f in PROCESS_FIELDS}}
            stats = [r["runtime"] for r in done if r.get("runtime")]
            if stats:
                entry["runtime"] = {k: statistics.median(v for s in stats if (v := s.get(k)) is not None)
                                    for k in RUNTIME_FIELDS if any(s.get(k) is not None for s in stats)}
            out.append(entry)
    return out


def per_prompt(runs: list[dict[str, Any]], caps: list[int], systems: tuple[str, ...], prompts: int) -> list[dict]:
    """Per cap: each prompt's median tokens/s per system and their range over the repeats, each
    runtime system's ratio over no-predictor per prompt (of the medians, and paired: repeat by
    repeat), and the median and range of those ratios over the prompts."""
    out = []
    for cap in caps:
        table = []
        for index in range(prompts):
            done = {system: {r["repeat"]: r["tokens_per_s"] for r in runs
                             if r["cap_bytes"] == cap and r["system"] == system and r.get("prompt_index") == index
                             and r["status"] == "ok" and r.get("tokens_per_s")} for system in systems}
            speeds = {system: statistics.median(by.values()) if by else None for system, by in done.items()}
            table.append({"prompt_index": index, "tokens_per_s": speeds,
                          "tokens_per_s_range": {system: [min(by.values()), max(by.values())] if by else None
                                                 for system, by in done.items()},
                          "over_no_predictor": _over(speeds, "no-predictor"),
                          "paired_over_no_predictor": _paired(done, "no-predictor")})
        ratios = {system: _spread([row["over_no_predictor"][system] for row in table
                                   if row["over_no_predictor"].get(system) is not None])
                  for system in systems if system != "no-predictor"}
        out.append({"cap_bytes": cap, "prompts": table, "median_over_no_predictor": ratios,
                    "median_paired_over_no_predictor": {system: paired_spread(table, system)
                                                        for system in systems if system != "no-predictor"}})
    return out


def paired_spread(prompts: list[dict[str, Any]], system: str) -> dict[str, float] | None:
    """Over `prompts` (a cap's `per_prompt` rows): the median and range of each prompt's median ratio
    repeat by repeat (`paired_over_no_predictor`). Its runs of one prompt and repeat follow each other,
    so a slow spell of the disk slows both sides of a ratio; a ratio of medians pairs one repeat's run
    with another's."""
    return _spread([statistics.median(ratios) for row in prompts
                    if (ratios := row.get("paired_over_no_predictor", {}).get(system))])


def _paired(done: dict[str, dict[int, float]], base: str) -> dict[str, list[float]]:
    """Each system's tokens/s over `base`'s in the same repeat (the rounds interleave the systems), per
    repeat where both finished: the spread a ratio of medians hides."""
    theirs = done.get(base, {})
    return {system: [mine[repeat] / theirs[repeat] for repeat in sorted(mine) if repeat in theirs]
            for system, mine in done.items() if system != base}


def _over(speeds: dict[str, float | None], base: str) -> dict[str, float | None]:
    theirs = speeds.get(base)
    return {system: mine / theirs if mine and theirs else None for system, mine in speeds.items() if system != base}


def ratios(summary: list[dict[str, Any]], caps: list[int]) -> list[dict[str, Any]]:
    """prescient's median tokens/s over plain's, mmap's and no-predictor's at each cap, and the
    runtime's (with and without its predictor) over llama.cpp's where it ran."""
    median = {(s["cap_bytes"], s["system"]): (s["tokens_per_s"] or {}).get("median") for s in summary}
    pairs = [("prescient", other) for other in ("plain", "mmap", "no-predictor")]
    if any(system == "llama.cpp" for _, system in median):
        pairs += [("prescient", "llama.cpp"), ("no-predictor", "llama.cpp")]
    out = []
    for cap in caps:
        entry: dict[str, Any] = {"cap_bytes": cap}
        for mine, other in pairs:
            ours, theirs = median.get((cap, mine)), median.get((cap, other))
            entry[f"{mine}/{other}"] = ours / theirs if ours and theirs else None
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
    result["per_prompt"] = per_prompt(result["runs"], caps, systems, len(result["settings"]["prompts"]))
    result["ratios"] = ratios(result["summary"], caps)
    result["plain_stops"] = plain_stops(result["summary"])
    write_json_atomic(json_path, result)


def bench_memory(model_dir: str | Path, caps: list[int], prompts: list[str], *, json_path: str | Path,
                 plot_path: str | Path | None = None, new_tokens: int = 128, repeats: int = 3, threads: int = 1,
                 predictor: str | None = None, systems: tuple[str, ...] | None = None, timeout_s: float = 1800.0,
                 runner: Runner = run_capped, llama_cpp: str | Path | None = None,
                 gguf: str | Path | None = None) -> dict[str, Any]:
    """Measure the curve (see the module doc); the JSON is rewritten after every run, the PNG at
    the end. `systems` defaults to every one (`prescient` only with a predictor, `llama.cpp` only
    with `llama_cpp`, its bin folder, and `gguf`). MemoryBenchError when an uncapped plain run, a
    reference, does not finish."""
    from experiments.machine import machine_info

    systems = default_systems(predictor, llama_cpp) if systems is None else systems
    if not caps or any(cap <= 0 for cap in caps) or unknown(systems) or not prompts:
        raise MemoryBenchError(f"give at least one positive cap, one prompt and systems among {', '.join(SYSTEMS)}")
    if set(WITH_PREDICTOR) & set(systems) and not predictor:
        raise MemoryBenchError("the prescient and prefetch systems are the runtime with its predictor: give --predictor")
    llama = check_llama_cpp(llama_cpp, gguf, "llama.cpp" in systems)
    kind = cgroup_kind()
    spec = {"model": str(model_dir), "new_tokens": new_tokens, "threads": threads,
            "predictor": predictor and str(predictor), **llama}
    result: dict[str, Any] = {
        "what": "decode tokens/s against a memory cap: plain transformers, the model memory-mapped, the runtime "
                "without a predictor, with it, and with an oracle",
        "settings": {**spec, "prompts": prompts, "caps_bytes": caps, "repeats": repeats, "systems": list(systems),
                     "timeout_s": timeout_s},
        "machine": machine_info(threads), "method": METHOD, "cgroup": kind, "how_counted": HOW_COUNTED[kind],
        "capped": kind != "none", "runs": []}
    with tempfile.TemporaryDirectory(prefix="bench-memory-oracle-") as traces:
        result["floor"] = child_run({**spec, "prompt": prompts[0], "system": "floor"}, None, runner, timeout_s)
        prompt_specs = [{**spec, "prompt": prompt, "prompt_index": index, "oracle_trace": f"{traces}/{index}"}
                        for index, prompt in enumerate(prompts)]
        references = [_reference(prompt_spec, runner, timeout_s) for prompt_spec in prompt_specs]
        result["reference"] = references[0]
        result["references"] = references
        result["warmups"] = _warm_up(prompt_specs[0], systems, runner, timeout_s)
        _write(result, caps, json_path)
        for cap in caps:
            for repeat in range(repeats):
                for prompt_spec, reference in zip(prompt_specs, references):
                    for system in rotated(systems, repeat + prompt_spec["prompt_index"]):
                        record = child_run({**prompt_spec, "system": system}, cap, runner, timeout_s)
                        record.update(repeat=repeat, prompt_index=prompt_spec["prompt_index"])
                        if record["status"] == "ok":
                            record["exact"] = same_greedy(record, reference)
                            if "text" in record and "token_ids" not in record:
                                record["text_equal"] = record["text"] == reference.get("text")
                        result["runs"].append(record)
                        _write(result, caps, json_path)
    if plot_path:
        plot_memory_curve(result, plot_path)
    return result


def rotated(systems: tuple[str, ...], by: int) -> tuple[str, ...]:
    """`systems` rotated left `by` places: the order of one prompt's round (see the module doc)."""
    by %= len(systems)
    return systems[by:] + systems[:by]


def default_systems(predictor: str | None, llama_cpp: str | Path | None) -> tuple[str, ...]:
    """Every system but `next` (cross-token prefetch needs a predictor with forecast heads: asked for by
    name), `prescient` and `prefetch` only with a predictor and `llama.cpp` only with its binary."""
    return tuple(s for s in SYSTEMS if s != "next" and (predictor or s not in WITH_PREDICTOR)
                 and (llama_cpp or s != "llama.cpp"))


def check_llama_cpp(llama_cpp: str | Path | None, gguf: str | Path | None, wanted: bool) -> dict[str, str | None]:
    """The spec's llama.cpp settings (absolute paths, checked now: a missing binary or GGUF is one
    line before any run), or None for both where the llama.cpp system is not run."""
    from experiments.bench_memory.llama_cpp import LlamaCppError, binary_path, check_gguf

    if not wanted:
        return {"llama_cpp": None, "gguf": None}
    if not llama_cpp or not gguf:
        raise MemoryBenchError("the llama.cpp system needs --llama-cpp (its build's bin folder) and --gguf (the model "
                               "converted to GGUF); see docs/memory.md")
    try:
        return {"llama_cpp": str(binary_path(llama_cpp).parent.resolve()), "gguf": str(check_gguf(gguf).resolve())}
    except LlamaCppError as exc:
        raise MemoryBenchError(str(exc)) from None


def same_greedy(record: dict[str, Any], reference: dict[str, Any]) -> bool:
    """Whether a run's greedy output is the uncapped plain model's: its token ids; for llama.cpp
    (whose ids are not ours) its text, the same as far as both go: the same text may end on another
    token boundary (llama.cpp's 96 tokens of runs/tw printed the plain model's 390 characters and a
    "\\n\\n" more), and llama.cpp ignores EOS where the plain model may stop."""
    if "token_ids" in record:
        return record["token_ids"] == reference["token_ids"]
    mine, theirs = record.get("text"), reference.get("text")
    if mine is None or theirs is None:
        return False
    return mine.startswith(theirs) or theirs.startswith(mine)


def _reference(spec: dict[str, Any], runner: Runner, timeout_s: float) -> dict[str, Any]:
    """The uncapped plain run of one prompt (its ids every run must equal), which also traces its
    own sequence for the oracle."""
    reference = child_run({**spec, "system": "plain"}, None, runner, timeout_s)
    if reference["status"] != "ok":
        raise MemoryBenchError(f"the uncapped plain run of prompt {spec['prompt_index']} ended {reference['status']}: "
                               f"{reference['cgroup']['stderr_tail'][-400:]}")
    return {**reference, "exact": True, "prompt_index": spec["prompt_index"]}


def _warm_up(spec: dict[str, Any], systems: tuple[str, ...], runner: Runner, timeout_s: float) -> dict[str, str]:
    """One uncapped, untimed run of each of the runtime's `systems` (its status by system): the kernels it
    compiles are cached before the first timed run (a new worktree's first predictor run measured 13 MB
    more and held 19 slots of 21 at 0.66 GB on runs/tb, results/bench-prediction-tb-cost-counted.json)."""
    return {system: child_run({**spec, "system": system}, None, runner, timeout_s)["status"]
            for system in systems if system in RUNTIME_SYSTEMS}


def unknown(systems: tuple[str, ...]) -> list[str]:
    return [s for s in systems if s not in SYSTEMS] or ([] if systems else ["(none)"])


def summary_text(result: dict[str, Any]) -> str:
    """One line per cap and system: tokens/s median [min-max], killed runs, exactness; then the ratios."""
    lines = [f"memory curve of {result['settings']['model']} (cgroup {result['cgroup']}; floor "
             f"{floor_bytes(result) / 2**30:.2f} GiB RSS; plain uncapped "
             f"{result['reference'].get('tokens_per_s') or 0:.1f} tok/s)"]
    for s in result["summary"]:
        speed, faults = s["tokens_per_s"], s.get("major_faults_per_token")
        text = f"{speed['median']:.1f} tok/s [{speed['min']:.1f}-{speed['max']:.1f}]" if speed else "-"
        hit = (s.get("runtime") or {}).get("hit_rate")
        lines.append(f"  {s['cap_bytes'] / 2**30:6.2f} GiB  {s['system']:<12} {text:<26} killed {s['killed']}/"
                     f"{s['runs']}  refused {s['refused']}/{s['runs']}  exact {s['exact']}"
                     + (f"  faults/token {faults['median']:.2f}" if faults else "")
                     + (f"  hit {hit:.2f}" if hit is not None else ""))
    for cap in result["per_prompt"]:
        for system, spread in cap["median_over_no_predictor"].items():
            if spread:
                lines.append(f"  {cap['cap_bytes'] / 2**30:6.2f} GiB  {system}/no-predictor over "
                             f"{len(cap['prompts'])} prompts: median {spread['median']:.2f} "
                             f"[{spread['min']:.2f}-{spread['max']:.2f}]")
    return "\n".join(lines)
