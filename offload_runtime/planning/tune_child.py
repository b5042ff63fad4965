"""One calibration run of `prescient tune` in a process of its own, run under the memory cap:

    python -m offload_runtime.planning.tune_child SPEC.pickle OUT.json

SPEC: (model_dir, prompts, new_tokens, predictor, RuntimeOptions). The model is loaded once and
each prompt decoded in turn, as a server meets its requests (the cache warm from the one before).
OUT: per prompt the decode's tokens/s, major page faults and bytes read from storage per token, the runtime statistics over
all of them and the memory plan, or {"refused": why} where the runtime refuses the cap.
"""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

from offload_runtime.engine.generate import check_prompt, timed_generate
from offload_runtime.engine.memory_plan import Reserves
from offload_runtime.engine.options import RuntimeOptions
from prescient.errors import CapacityError
from prescient.model_dir import ModelDirectory


def decode(model_dir: str, prompts: list[str], new_tokens: int, predictor: str | None,
           options: RuntimeOptions) -> dict:
    """Greedy decodes of `prompts` through one `load_offloaded` model: per prompt tokens/s and
    major page faults per token; statistics over all; the memory plan."""
    from offload_runtime.engine.loader import load_offloaded

    directory = ModelDirectory.of(model_dir)
    tokenizer = directory.tokenizer()
    inputs = [tokenizer(prompt, return_tensors="pt") for prompt in prompts]
    for tokens in inputs:
        check_prompt(tokens["input_ids"].shape[1], new_tokens, directory)
    longest = Reserves(context_tokens=max(t["input_ids"].shape[1] for t in inputs) + new_tokens)
    model = load_offloaded(directory, predictor, options, reserves=longest)
    with model:
        timed = [timed_generate(model, tokenizer, tokens.to(options.device), new_tokens) for tokens in inputs]
        stats, plan = model.runtime.stats(), model.plan
    return {"tokens_per_s": [t["tokens_per_s"] for t in timed],
            "decode_major_faults_per_token": [t["decode_major_faults_per_token"] for t in timed],
            "decode_read_bytes_per_token": [t["decode_read_bytes_per_token"] for t in timed],
            "stats": stats.to_dict(), "memory_plan": plan.to_json() if plan is not None else None}


def main(spec_path: str, out_path: str) -> None:
    spec = pickle.loads(Path(spec_path).read_bytes())
    try:
        out = decode(*spec)
    except CapacityError as exc:
        out = {"refused": str(exc)}
    Path(out_path).write_text(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:])
