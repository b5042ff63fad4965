"""A cap too small is refused in seconds, a cap just above decodes: `prescient generate --memory CAP`
in a memory cgroup capped at CAP, the page cache dropped first, for each cap (issue 53's refusal).

    python -m experiments.refusal --model runs/tb --predictor runs/demo/predictor/sida \
        --caps 400,435,489,520 --json results/refusal-tb.json

Per cap: the exit status (2: refused), whether the kernel killed it, the seconds it took, its last
line on stderr, and for a run that decoded its tokens/s, major faults per token and memory plan.
With `--cold`, numba's on-disk cache of this checkout's kernels is cleared before the first cap: that
run is a fresh checkout's first (`--caps 660,660`: a first run and the next at one cap).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

from experiments.machine import machine_info
from offload_runtime.engine.compiled import KERNEL_PACKAGES
from prescient.atomic import write_results
from prescient.capped_run import drop_page_cache, run_capped

PROMPT = "def read_config(path):\n"
NEW_TOKENS = 32


def clear_kernel_cache() -> int:
    """Delete numba's on-disk cache of this checkout's kernels (the working folder's); how many files."""
    files = [path for package in KERNEL_PACKAGES for path in Path(package).rglob("__pycache__/*.nb[ic]")]
    for path in files:
        path.unlink()
    return len(files)


def one_cap(model: str, predictor: str | None, cap_mib: int, timeout_s: float) -> dict[str, Any]:
    """One `generate --memory {cap_mib}MiB` in a cgroup capped at that size."""
    with tempfile.TemporaryDirectory(prefix="prescient-refusal-") as tmp:
        out = Path(tmp, "generate.json")
        argv = [sys.executable, "-m", "cli.main", "generate", "--model", model, "--memory", f"{cap_mib}MiB",
                "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS), "--json", str(out)]
        argv += ["--predictor", predictor] if predictor else []
        drop_page_cache()
        run = run_capped(argv, cap_mib * 2**20, timeout_s)
        lines = [line for line in run.stderr_tail.splitlines() if line.strip()]
        entry = {"cap_mib": cap_mib, "exit": run.returncode, "killed": run.killed, "timed_out": run.timed_out,
                 "seconds": run.seconds, "last_line": lines[-1] if lines else ""}
        if out.is_file():
            result = json.loads(out.read_text())
            entry.update(tokens_per_s=result.get("tokens_per_s"),
                         decode_major_faults_per_token=result.get("decode_major_faults_per_token"),
                         memory_plan=result.get("memory_plan"))
    return entry


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--predictor")
    parser.add_argument("--caps", required=True, help="MiB, comma-separated")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before a run is stopped")
    parser.add_argument("--json", required=True)
    parser.add_argument("--cold", action="store_true", help="clear numba's cache of the kernels before the first cap")
    args = parser.parse_args(argv)
    caps = [int(cap) for cap in args.caps.split(",")]
    command = (f"prescient generate --model {args.model}" + (f" --predictor {args.predictor}" if args.predictor else "")
               + f" --memory CAP --prompt {shlex.quote(PROMPT.encode('unicode_escape').decode())} --max-new-tokens "
               f"{NEW_TOKENS}, through prescient.capped_run.run_capped"
               + (" (numba's cache of the kernels cleared before the first cap)" if args.cold else ""))
    record = {"what": f"generate --memory CAP on {args.model}, each in a memory cgroup capped at CAP, page cache "
                      "dropped first: refused (exit 2) or run, and in how many seconds",
              "command": command, "machine": machine_info(1), "runs": []}
    if args.cold:
        record["kernel_cache_files_cleared"] = clear_kernel_cache()
    for index, cap in enumerate(caps):
        record["runs"].append(one_cap(args.model, args.predictor, cap, args.timeout))
        entry = record["runs"][-1]
        entry["kernel_cache"] = "cleared" if args.cold and index == 0 else "kept"
        print(f"{cap} MiB: exit {entry['exit']}, {entry['seconds']} s: {entry['last_line'][-120:]}", flush=True)
        write_results(record, args.json)


if __name__ == "__main__":
    main()
