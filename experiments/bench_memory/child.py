"""One run of the memory curve, in a process of its own under the cap:

    python -m experiments.bench_memory.child SPEC.json OUT.json

SPEC: {"system": "floor" | "plain" | "mmap" | "prescient" | "llama.cpp" | ..., "model", "prompt", "new_tokens",
"threads", "memory" (the cap in bytes, or null), "predictor" (prescient's artifact, or null),
"llama_cpp" and "gguf" (llama.cpp's bin folder and the model's GGUF, or null)}.
OUT: the system's record (token ids, prefill seconds, decode tokens/s, ...), or {"refused": why}
where the runtime refuses the cap (a `CapacityError`: too small for it, by its own account), and
this process's memory at the end (`proc_status`). `floor` imports torch, transformers and the runtime and loads
nothing: the memory any of the systems holds before its model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

FIELDS = ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem")
RUNTIME_SYSTEMS = ("no-predictor", "prescient", "prefetch", "next", "oracle")  # those of `systems.RUNNERS` that run the runtime


def proc_status() -> dict[str, int]:
    """This process's peak and current RSS, split anonymous / file-backed, in bytes (Linux)."""
    out = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in FIELDS:
                out[name] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def run(spec: dict[str, Any]) -> dict[str, Any]:
    if spec["system"] == "llama.cpp":  # its own process beside this one, which loads nothing of torch
        from experiments.bench_memory.llama_cpp import run_llama_cpp

        return run_llama_cpp(spec)
    if spec["memory"] is not None and spec["system"] in RUNTIME_SYSTEMS:
        # the kernels numba's cache lacks compiled while this process is small, as `prescient generate --memory` does
        from offload_runtime.engine.compiled import compile_ahead

        compile_ahead()
    import torch
    import transformers  # noqa: F401  (the floor holds it)

    import offload_runtime.engine.generate  # noqa: F401
    import offload_runtime.engine.loader  # noqa: F401

    torch.set_num_threads(spec["threads"])
    if spec["system"] == "floor":
        return {}
    from experiments.bench_memory.systems import RUNNERS

    return RUNNERS[spec["system"]](spec)


def main(argv: list[str]) -> None:
    spec_path, out_path = argv
    from prescient.errors import CapacityError

    spec = json.loads(Path(spec_path).read_text())
    try:
        record = run(spec)
    except CapacityError as exc:
        record = {"refused": str(exc)}
    record["proc_status"] = proc_status()
    Path(out_path).write_text(json.dumps(record))


if __name__ == "__main__":
    main(sys.argv[1:])
