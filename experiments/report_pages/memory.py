"""The results page `memory`: decode tokens/s against a memory cap for the whole process, the
project's runtime (`--memory`, its tuned default) beside plain transformers and the model
memory-mapped from its safetensors files, each run in a cgroup capped at the size (`bench --memory`);
and what `prescient tune` measured at two of those sizes."""

from __future__ import annotations

from functools import partial
from typing import Any

from experiments.report_tables import Headline, Page, Rows, Table, load, num, spread

CURVE = "bench-memory-tb.json"
CURVE_WIDE = "bench-memory-tw.json"  # the same model's experts three times wider: they dwarf the import floor
CURVE_WHOLE = "bench-memory-tw-whole.json"  # runs/tw at the caps where plain runs, the experts copied where all fit
TUNE = "tune-tb.json"
TUNE_WIDE = "tune-tw.json"  # under the three-prompt rule
TRACE = "trace-offloaded-tb.json"
# the same trace in a cgroup capped at the size (experiments.trace_capped): runs/tb; before trace cut its
# batch to the plan's reserve; runs/tb widened to twice the experts' bytes
TRACE_CAPPED, TRACE_CAPPED_UNCUT, TRACE_CAPPED_2X = ("trace-capped-tb.json", "trace-capped-tb-batch16.json",
                                                     "trace-capped-tb2x.json")
TRACE_CAPPED_WIDE = "trace-capped-tw.json"  # runs/tw at 1.09 GB: its experts 2.01x the cap
GB = 1e9


def _speed(entry: dict[str, Any]) -> str:
    """A system's median tokens/s (range) at one cap, or why it has none."""
    for status in ("killed", "refused", "timeout", "failed"):
        if entry[status] and not entry["tokens_per_s"]:
            return f"{status} ({entry[status]} of {entry['runs']})"
    t = entry["tokens_per_s"]
    return spread(t["median"], [t["min"], t["max"]], 1) + ("" if entry["exact"] else " NOT EXACT")


def _plans(result: dict[str, Any], cap: int) -> str:
    """What the runtime's memory plan chose at `cap` (the runs agree, being the same computation)."""
    plans = {("mapped" if p.get("mapped") else "resident" if p["resident"]
              else f"{p['slots']} of {p['total_experts']} slots")
             for r in result["runs"] if r["system"] == "prescient" and r["cap_bytes"] == cap
             and (p := r.get("memory_plan"))}
    return ", ".join(sorted(plans)) or "–"


def _read_mib(entry: dict[str, Any]) -> str:
    """A system's median MiB read from storage per decoded token (range), where the runs counted it."""
    read = entry.get("read_bytes_per_token")
    return spread(read["median"] / 2**20, [read["min"] / 2**20, read["max"] / 2**20], 0) if read else "–"


def curve_rows(name: str) -> Rows:
    result = load(name)
    by = {(s["cap_bytes"], s["system"]): s for s in result["summary"]}
    ratios = {r["cap_bytes"]: r for r in result["ratios"]}
    rows = []
    for cap in result["settings"]["caps_bytes"]:
        mine = by[(cap, "prescient")]
        runtime = mine.get("runtime") or {}
        rows.append([num(cap / GB, 2), _speed(by[(cap, "plain")]), _speed(by[(cap, "mmap")]), _speed(mine),
                     num(ratios[cap]["prescient/plain"]), num(ratios[cap]["prescient/mmap"]), _plans(result, cap),
                     num(runtime.get("hit_rate"), 3), num(runtime.get("stall_ms_per_token"), 1),
                     num(runtime["bytes_moved_per_token"] / 2**20, 1) if runtime else "–",
                     _read_mib(by[(cap, "mmap")]), _read_mib(mine)])
    return ["cap (GB)", "plain tokens/s", "mmap tokens/s", "prescient tokens/s", "prescient / plain",
            "prescient / mmap", "prescient's plan", "hit rate", "stall ms/token", "MiB moved/token",
            "mmap: MiB read from disk/token", "prescient: MiB read from disk/token"], rows


def tune_rows(name: str) -> Rows:
    result = load(name)
    rows = []
    for best in result["best"]:
        settings = ", ".join(f"{k} {v}" for k, v in best["settings"].items())
        rows.append([num(best["memory"] / GB, 2), spread(best["tokens_per_s"], best["spread"], 1),
                     ", ".join(best["kept"]) or "(the defaults)", settings])
    return ["memory (GB)", "best tokens/s, mean over the prompts (range)", "changes kept", "settings"], rows


def page() -> Page:
    setup = ("the demo's reference model with its experts widened as configs/reference/bench.yaml widens the base "
             "one (runs/tb: 4 layers of 16 experts, 733 MB of float32 experts), a SiDA predictor with two forecast "
             "heads, one torch thread")
    curve_cmd = ("prescient bench --model runs/tb --predictor runs/tb-predictor/sida --memory "
                 "0.45GB,0.55GB,0.65GB,0.85GB,1.0GB,1.1GB,1.3GB --repeats 3 --new-tokens 96 --run-timeout 240 "
                 "--json ... --plot ...")
    wide_setup = ("runs/tw, configs/reference/tiny-bench-wide.yaml: the same trained model, 64 experts of 34.2 MB, "
                  "2.2 GB of float32 experts, the same predictor, one torch thread")
    wide_cmd = ("prescient bench --model runs/tw --predictor runs/tb-predictor/sida --memory "
                "1.1GB,1.7GB,2.2GB,2.8GB,3.3GB --repeats 3 --new-tokens 96 --run-timeout 60 --json ... --plot ...")
    whole_cmd = ("prescient bench --model runs/tw --predictor runs/tb-predictor/sida --memory 2.8GB,3.3GB --repeats 3 "
                 "--new-tokens 96 --run-timeout 60 --json ...")
    tune_cmd = ("prescient tune --model runs/tb --predictor runs/tb-predictor/sida --memory 0.65GB,0.85GB "
                "--json ...")
    tune_wide_cmd = ("prescient tune --model runs/tw --predictor runs/tb-predictor/sida --memory 1.1GB,1.7GB "
                     "--new-tokens 32 --json ...")
    return Page("memory", "Speed against memory", """
Each system decodes the same prompt greedily in a fresh process inside a memory cgroup capped at the
size, which counts the page cache as a real machine does; the page cache is dropped before every run,
and every run that finished computed the plain model's tokens. The plain transformers model copies
every weight into anonymous memory: on runs/tb it is killed below 1.3 GB, on runs/tw it runs from
2.8 GB and below that thrashes past the run limit. The project's runtime (`--memory`, with what
`prescient tune` kept on this machine where it was tuned, else the built-in defaults) copies every
expert into memory where they all fit (the plain model), maps every weight from the checkpoint where
the page cache can hold 80% of the experts, and below that keeps a share of the experts in slots (the
plan column says which; the runs/tw curve at 2.8 and 3.3 GB predates copying where all fit, and the
table after it measures the copy there).

Two models, one trained router: on runs/tb (733 MB of experts) importing torch and transformers
holds about 0.46 GB, most of any cap that would be "0.4x the plain model's need", so nothing runs
below 0.55 GB; on runs/tw the same experts are three times wider (2.2 GB) and dwarf that floor.
There the runtime decodes at 1.1 GB (0.4x of plain's 2.8 GB) at about a third of plain's uncapped
16.0 tokens/s and at 1.7 GB (0.6x) at nearly all of it. At 1.1 GB it decoded 1.8x the
memory-mapped model in this run: the slots read 104-107 MiB from disk per token at a 0.80 hit rate,
the mapping 223-241 MiB (the kernel's read-ahead, 8 MiB on this machine's disk, reads past what a
token uses, and the cgroup takes it back before it is used). That model is unsteady there: in the
curve before this one (results/bench-memory-tw.json as of commit 4b2aadd) it decoded once at 3.1 and
once at 8.4 tokens/s, with 12.2 and 2.2 major page faults per token, and in `tune`'s runs at 1.1 GB
the mapped experts beat the slots on two of three prompts and lost on the third (so tune kept the
slots). At 1.7 GB the two tie and both run near the plain model's own speed: no offloading can be
1.3x faster there, the ceiling being the all-resident 16.0 tokens/s. The slots' own bound at 1.1 GB:
about 105 MiB read per token at this disk's 0.52-0.83 GB/s (tune-tw.json's read curve at the expert's
34 MB, depth 1 to 16) is 130-210 ms beside about 70 ms of compute (1/5.5 tokens/s less the 114 ms stall), and the stall column shows those
reads are not hidden behind compute; moving it needs fewer bytes per expert (int4 packed slots,
opt-in) or prefetch issued further ahead. At 0.65 GB on runs/tb the policy tune kept from one calibration prompt (LRU) fell to a
0.68 hit rate on this prompt: tune now calibrates on three prompts and keeps a change only where it
wins on each; on runs/tw under that rule no change won at either size.
""", (
        Table(f"Decode tokens/s against the memory cap ({setup}; 96 new tokens, 3 interleaved repeats, medians "
              "and ranges)", (CURVE,), curve_cmd, partial(curve_rows, CURVE)),
        Table(f"The same, with the experts three times wider ({wide_setup}; 96 new tokens, 3 interleaved repeats, "
              "medians and ranges; a run past 60 s is stopped as timed out: at the plain model's uncapped speed "
              "one takes about 20 s)", (CURVE_WIDE,), wide_cmd, partial(curve_rows, CURVE_WIDE)),
        Table("runs/tw where the plain model runs, after `--memory` copies every expert where they all fit (the same "
              "conditions, 3 interleaved repeats)", (CURVE_WHOLE,), whole_cmd, partial(curve_rows, CURVE_WHOLE)),
        Table("What `prescient tune` kept on runs/tb at two sizes, on one calibration prompt (before the three-prompt "
              "rule; 2 interleaved runs per configuration, 48 new tokens, each run a fresh process in a cgroup capped "
              "at the size, page cache dropped first)", (TUNE,), tune_cmd, partial(tune_rows, TUNE)),
        Table("What `prescient tune` kept on runs/tw at 0.4x and 0.6x of the plain model's need: three calibration "
              "prompts, a change kept only where it wins on each (2 interleaved runs per configuration, 32 new "
              "tokens per prompt, each run a fresh process in a cgroup capped at the size, page cache dropped first)",
              (TUNE_WIDE,), tune_wide_cmd, partial(tune_rows, TUNE_WIDE)),
        Table("`prescient trace` through the runtime: 4 096 tokens of stdlib-code, whole and under a cap, 2 "
              "interleaved runs each (no cgroup: the runtime drops the pages it reads)", (TRACE,),
              load(TRACE)["command"], trace_rows),
        *(Table(f"`prescient trace` of {model} under a real cap: the same 4 096 tokens, each run a fresh process "
                f"in a memory cgroup capped at the size (the resident trace uncapped), the page cache dropped before "
                f"each, {load(name)['settings']['repeats']} interleaved repeats (medians and ranges){when}",
                (name,), load(name)["command"], partial(trace_capped_rows, name))
          for name, model, when in (
              (TRACE_CAPPED, "runs/tb (0.73 GB of experts)", "; under `--memory` 4 windows per forward, the "
               "512-token prefill the plan reserves"),
              (TRACE_CAPPED_UNCUT, "runs/tb", ", before `trace --memory` cut its batch: 16 windows of 128 tokens "
               "per forward, beyond the plan's reserve"),
              (TRACE_CAPPED_2X, "runs/tb2x (runs/tb widened by zeros to 1.46 GB of experts, the same routing)",
               "; under `--memory` 4 windows per forward"),
              (TRACE_CAPPED_WIDE, "runs/tw (configs/reference/tiny-bench-wide.yaml: 2.2 GB of experts, the same "
               "routing)", "; under `--memory` 4 windows per forward, the prefill workspace reserved for the top-k "
               "rows"))),
    ))


def trace_rows() -> Rows:
    """Per way of loading: wall time of each run, its ratio to the whole model's, traced tokens/s,
    and whether the routing equals the whole model's."""
    result = load(TRACE)
    whole = sum(r["wall_s"] for r in result["runs"]["resident"])
    rows = []
    for name, flag in (("resident", "none (whole)"), ("memory", "--memory 0.65GB"), ("budget", "--budget 25%")):
        runs = result["runs"][name]
        equal = [v for k, v in result["routing_equal_to_the_whole_models"].items() if k.startswith(name)]
        rows.append([flag, " / ".join(num(r["wall_s"], 1) for r in runs),
                     f"{num(sum(r['wall_s'] for r in runs) / whole)}×",
                     " / ".join(num(r["trace_tokens_per_s"], 0) for r in runs),
                     "reference" if name == "resident" and len(equal) == 1 else f"{sum(equal)} of {len(equal)}"])
    return ["cap", "wall s (the whole command)", "× whole", "traced tokens/s", "every column equal to the whole "
            "model's"], rows


def trace_capped_rows(name: str) -> Rows:
    """Per way of loading in `name`: the cap and how far the experts exceed it, wall time, its ratio to
    the resident trace's, the cgroup's peak, what the plan bought, and the routing against the resident's."""
    result = load(name)
    rows = []
    for kind, entry in result["summary"].items():
        wall, peak = entry["wall_s"], entry["peak_bytes"]
        plans = {r["plan"].split(": ", 1)[1].split(";")[0] for r in result["runs"]
                 if r["kind"] == kind and r.get("plan")}
        cap = next(r["cap_bytes"] for r in result["runs"] if r["kind"] == kind)
        rows.append([kind if cap is None else f"--memory {num(cap / GB)}GB", num(entry["experts_over_cap"]),
                     spread(wall["median"], [wall["min"], wall["max"]], 1) if wall else "–",
                     f"{num(entry['wall_ratio_to_resident'])}×" if entry["wall_ratio_to_resident"] else "–",
                     num(peak["max"] / GB) if peak else "–",
                     ", ".join(sorted(plans)) or ("whole model" if cap is None else "–"),
                     f"{entry['ok']} of {entry['runs']} ran, {entry['killed']} killed, "
                     f"{entry['runs'] - entry['ok'] - entry['killed']} refused by the plan",
                     "reference" if cap is None else {True: "yes", False: "NO", None: "–"}[entry["routing_equal"]]])
    return ["cap", "experts / cap", "wall s (the whole command)", "× resident", "cgroup peak (GB)", "plan", "runs",
            "every column equal to the resident trace's"], rows


def _plain_need() -> float:
    """The smallest cap at which the plain model ran, in GB."""
    return load(CURVE)["plain_stops"]["smallest_running_cap_bytes"] / GB


def _smallest_prescient() -> float:
    result = load(CURVE)
    ran = [s["cap_bytes"] for s in result["summary"] if s["system"] == "prescient" and s["tokens_per_s"]]
    return min(ran) / GB


HEADLINES: tuple[Headline, ...] = (
    Headline("Memory: the smallest cap the runtime decoded in, against the smallest the plain transformers model "
             "ran in (whole process, cgroup counting the page cache; demo model widened)",
             lambda: f"{num(_smallest_prescient())} GB against {num(_plain_need())} GB", "memory", CURVE),
)
