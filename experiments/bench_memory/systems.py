"""The three systems of the memory curve, each one greedy generation of a prompt in the calling
process (the child under the cap), timed as `generate_offloaded` times it: a streamer notes the
prompt's put and each new token; prefill runs to the first new token, decode from there to the last.

- `plain`: transformers' own model, `from_pretrained` + `generate` (the anchor).
- `mmap`: the same model with its weights zero-copy views of the memory-mapped safetensors files
  (`offload_runtime.engine.mapped`): the kernel's page cache is the expert cache.
- `prescient`: `generate_offloaded` with what `--memory CAP` runs by default (`tuned.memory_options`:
  the configuration `prescient tune` measured best on this machine, else the built-in defaults).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from offload_runtime.engine.generate import generate_offloaded, timed_generate

SYSTEMS = ("plain", "mmap", "prescient")


def greedy(model: nn.Module, tokenizer, spec: dict[str, Any]) -> dict[str, Any]:
    """Greedy ids after the spec's prompt (up to its `new_tokens`, as `generate_offloaded` asks),
    prefill seconds, decode tokens/s, and major page faults and bytes read from storage per token."""
    return timed_generate(model, tokenizer, tokenizer(spec["prompt"], return_tensors="pt"), spec["new_tokens"])


def run_plain(spec: dict[str, Any]) -> dict[str, Any]:
    from prescient.model_dir import ModelDirectory, model_class

    directory = ModelDirectory.open(spec["model"])
    model = model_class(directory.config).from_pretrained(directory.path).eval()
    return greedy(model, directory.tokenizer(), spec)


def run_mmap(spec: dict[str, Any]) -> dict[str, Any]:
    from offload_runtime.engine.mapped import load_mmap_model, mapped_share
    from prescient.model_dir import ModelDirectory

    directory = ModelDirectory.open(spec["model"])
    model, _ = load_mmap_model(directory)
    record = greedy(model, directory.tokenizer(), spec)
    return {**record, "mapped_share": mapped_share(model)}


def run_prescient(spec: dict[str, Any]) -> dict[str, Any]:
    """`generate_offloaded` with `--memory`'s default configuration at `spec["memory"]` (None: the
    built-in budget); the runtime's statistics cover prefill and decode."""
    from offload_runtime.engine.options import RuntimeOptions
    from offload_runtime.planning.tuned import memory_options

    options = RuntimeOptions() if spec["memory"] is None else \
        memory_options(spec["model"], spec["memory"], spec.get("predictor"))
    out = generate_offloaded(spec["model"], spec["prompt"], spec["new_tokens"], predictor=spec.get("predictor"),
                             options=options)
    stats, tokens = out["stats"], max(len(out["token_ids"]), 1)
    return {"token_ids": out["token_ids"], "prefill_seconds": out["prefill_seconds"],
            "tokens_per_s": out["tokens_per_s"], "decode_major_faults_per_token": out["decode_major_faults_per_token"],
            "decode_read_bytes_per_token": out["decode_read_bytes_per_token"],
            "settings": out["settings"], "memory_plan": out["memory_plan"],
            "runtime": {"hit_rate": stats["hit_rate"], "bytes_moved_per_token": stats["bytes_moved"] / tokens,
                        "stall_ms_per_token": 1000 * stats["stall_seconds"] / tokens, "slots": stats["slots"],
                        "slot_bytes": stats["slot_bytes"], "stats": stats}}


RUNNERS = {"plain": run_plain, "mmap": run_mmap, "prescient": run_prescient}
