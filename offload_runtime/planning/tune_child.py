"""One calibration decode of `prescient tune` in a process of its own, run under the memory cap:

    python -m offload_runtime.planning.tune_child SPEC.pickle OUT.json

SPEC: (model_dir, prompt, new_tokens, predictor, RuntimeOptions). OUT: the decode's tokens/s,
runtime statistics and memory plan, or {"refused": why} where the runtime refuses the cap.
"""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

from offload_runtime.engine.generate import generate_offloaded
from prescient.errors import CapacityError


def decode(model_dir: str, prompt: str, new_tokens: int, predictor: str | None, options) -> dict:
    """`generate_offloaded` once: tokens/s, statistics and memory plan."""
    result = generate_offloaded(model_dir, prompt, new_tokens, predictor=predictor, options=options)
    return {key: result[key] for key in ("tokens_per_s", "stats", "memory_plan")}


def main(spec_path: str, out_path: str) -> None:
    spec = pickle.loads(Path(spec_path).read_bytes())
    try:
        out = decode(*spec)
    except CapacityError as exc:
        out = {"refused": str(exc)}
    Path(out_path).write_text(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:])
