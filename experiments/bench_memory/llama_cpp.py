"""llama.cpp as a system of the memory curve (optional, never a dependency): its `llama-completion`
greedy on a GGUF of the same model, run from the bench's child process, so in the same memory
cgroup under the same cap as the other systems, the GGUF memory-mapped (llama.cpp's default way to
load, `-lm mmap`).

- decode tokens/s: its own account, the "eval time = X ms / N runs" line it prints at the end
  (decode only: the prompt's evaluation is another line);
- bytes read from storage per decoded token: its process's /proc/<pid>/io `read_bytes`, read each
  time a piece of its output arrives (it prints each token as it is sampled; the prompt is not
  echoed): from the first piece to the last, over the N decode runs, as `timed_generate` counts
  ours from the first new token to the last;
- its text: what it printed, compared by the orchestrator with the plain model's greedy text.

Build llama.cpp and convert a checkpoint as ../shared/bin/build-llama-cpp's header says (docs:
docs/memory.md); `prescient bench --memory ... --llama-cpp DIR --gguf M.gguf` runs it.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from prescient.errors import PrescientError
from prescient.proc_io import storage_reads

BINARY = "llama-completion"
EVAL_LINE = re.compile(r"^.*?\beval time\s*=\s*([\d.]+) ms /\s*(\d+) runs", re.MULTILINE)
PROMPT_LINE = re.compile(r"prompt eval time\s*=\s*([\d.]+) ms /\s*(\d+) tokens")


class LlamaCppError(PrescientError):
    """llama.cpp cannot be run as asked: no binary, no GGUF, or output without its timings."""


def binary_path(bin_dir: str | Path) -> Path:
    """`llama-completion` in `bin_dir` (a llama.cpp build's bin folder, or the folder above
    `build/bin`); a LlamaCppError naming what is missing, in one line, where it is not there."""
    folder = Path(bin_dir)
    for candidate in (folder / BINARY, folder / "build" / "bin" / BINARY):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise LlamaCppError(f"no executable {BINARY} in {folder} (nor in {folder / 'build' / 'bin'}): build llama.cpp "
                        "with ../shared/bin/build-llama-cpp DIR and give DIR/llama.cpp/build/bin")


def check_gguf(path: str | Path) -> Path:
    """`path` if it is a GGUF file (its magic), else a one-line LlamaCppError."""
    gguf = Path(path)
    try:
        with gguf.open("rb") as file:
            magic = file.read(4)
    except OSError as exc:
        raise LlamaCppError(f"cannot read the GGUF {gguf}: {exc.strerror or exc}") from None
    if magic != b"GGUF":
        raise LlamaCppError(f"{gguf} is not a GGUF file (it starts {magic!r}); convert the model with llama.cpp's "
                            "convert_hf_to_gguf.py (docs/memory.md)")
    return gguf


def parse_timings(log: str) -> dict[str, float]:
    """Decode tokens/s from the "eval time = X ms / N runs" line of llama.cpp's timings (not the
    "prompt eval time" line), and the prompt's ms where printed; a LlamaCppError without it."""
    decode = [m for m in EVAL_LINE.finditer(log) if "prompt eval" not in m.group(0)]
    if not decode:
        raise LlamaCppError("llama.cpp printed no 'eval time = X ms / N runs' line; its log ends: "
                            + " | ".join(log.strip().splitlines()[-3:]))
    ms, runs = float(decode[-1].group(1)), int(decode[-1].group(2))
    prompt = PROMPT_LINE.search(log)
    return {"decode_ms": ms, "decode_runs": runs, "tokens_per_s": 1000.0 * runs / ms if ms > 0 else 0.0,
            "prompt_ms": float(prompt.group(1)) if prompt else None}


def command(spec: dict[str, Any]) -> list[str]:
    """llama-completion's greedy decode of the spec's prompt: `new_tokens`, `threads`, mapped."""
    return [str(binary_path(spec["llama_cpp"])), "-m", str(check_gguf(spec["gguf"])), "-p", spec["prompt"],
            "-n", str(spec["new_tokens"]), "-t", str(spec["threads"]), "--temp", "0", "--ignore-eos", "-no-cnv",
            "--no-display-prompt", "-lm", "mmap"]


def run_llama_cpp(spec: dict[str, Any], attempts: int = 3) -> dict[str, Any]:
    """One greedy run (see the module doc): text, decode tokens/s, bytes read per decoded token.
    llama.cpp's log thread now and then loses the last lines of its timings when the process ends
    (its log stops at "load time", the process exits 0): such a run is run again, up to `attempts`
    runs in all, and the result says how many ran."""
    for attempt in range(1, attempts + 1):
        text, log, reads = _completion(spec)
        try:
            timings = parse_timings(log)
        except LlamaCppError:
            if attempt == attempts:
                raise
            continue
        known = [r for r in reads if r is not None]
        runs = timings["decode_runs"]
        per_token = (known[-1] - known[0]) / runs if len(known) > 1 and runs else None
        return {"text": text, "tokens_per_s": timings["tokens_per_s"],
                "prefill_seconds": None if timings["prompt_ms"] is None else timings["prompt_ms"] / 1000,
                "decode_read_bytes_per_token": per_token, "output_pieces": len(reads), "llama_cpp": timings,
                "attempts": attempt}
    raise ValueError(f"attempts must be at least 1, got {attempts}")


def _completion(spec: dict[str, Any]) -> tuple[str, str, list[int | None]]:
    """One llama-completion process: its printed text, its log, and its storage reads at each
    piece of output."""
    with tempfile.TemporaryFile() as errors:  # a file, not a pipe: its log thread must never block on a full pipe
        process = subprocess.Popen(command(spec), stdout=subprocess.PIPE, stderr=errors, bufsize=0)
        pieces, reads = [], []
        while chunk := process.stdout.read(4096):
            reads.append(storage_reads(process.pid))
            pieces.append(chunk)
        process.wait()
        errors.seek(0)
        log = errors.read().decode("utf-8", "replace")
    if process.returncode != 0:
        raise LlamaCppError(f"llama-completion exited {process.returncode}: "
                            + " | ".join(log.strip().splitlines()[-3:]))
    return b"".join(pieces).decode("utf-8", "replace"), log, reads
