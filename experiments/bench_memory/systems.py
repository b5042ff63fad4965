"""The three systems of the memory curve, each one greedy generation of a prompt in the calling
process (the child under the cap), timed as `generate_offloaded` times it: a streamer notes the
prompt's put and each new token; prefill runs to the first new token, decode from there to the last.

- `plain`: transformers' own model, `from_pretrained` + `generate` (the anchor).
- `mmap`: the same model with its weights zero-copy views of the memory-mapped safetensors files
  (`offload_runtime.engine.mapped`): the kernel's page cache is the expert cache.
- `no-predictor`: the runtime as `--memory CAP` runs it without a predictor (LRU, demand loads).
- `prescient`: `generate_offloaded` with what `--memory CAP --predictor P` runs by default
  (`engine.resolve.resolve_options`: the configuration `prescient tune` measured best on this machine, else
  the built-in defaults).
- `prefetch`: `prescient` with SiDA's in-token prefetch on (each predicted token's top-k experts per
  layer, `prefetch_per_layer`), the default only where the slots are on a GPU: the CPU's default
  measured beside it.
- `next`: `prescient` with cross-token prefetch on (the forecast heads' next-token experts of chance
  at least 0.5, `next_token_min_chance`, the model's top-k per layer at most: what the oracle does
  with certain forecasts); on the CPU under learned eviction nothing in-token beside it.
- `oracle`: the runtime with a predictor that knows the run's true routing (`OraclePredictor` over
  the reference run's own trace: the prompt and the plain model's tokens): learned eviction on
  certain forecasts (Belady's rule over the next 8 tokens), prefetch of every layer's experts and of
  the next token's, SiDA's wait for each table. What prediction could win at that cap.
- `llama.cpp`: llama.cpp's `llama-completion` on a GGUF of the model, memory-mapped (`llama_cpp`;
  optional: only where its binary and the GGUF are given).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from offload_runtime.engine.generate import generate_offloaded, timed_generate

SYSTEMS = ("plain", "mmap", "no-predictor", "prescient", "prefetch", "next", "oracle", "llama.cpp")  # llama.cpp: `llama_cpp`, run by `child`
WITH_PREDICTOR = ("prescient", "prefetch", "next")  # the systems that run the user's predictor
RUNTIME_SYSTEMS = ("no-predictor", *WITH_PREDICTOR, "oracle")  # the offloading runtime's (its compiled kernels)
NEXT_TOKEN_MIN_CHANCE = 0.5  # the `next` system's and the oracle's cross-token prefetch threshold (generate's default)
ORACLE_OPTIONS = {"policy": "learned-belady", "next_token_min_chance": NEXT_TOKEN_MIN_CHANCE, "table_wait": 0.05,
                  "prediction_guard": False}  # the oracle is the bound: nothing guards it


def greedy(model: nn.Module, tokenizer, spec: dict[str, Any]) -> dict[str, Any]:
    """Greedy ids after the spec's prompt (up to its `new_tokens`, as `generate_offloaded` asks),
    prefill seconds, decode tokens/s, and major page faults and bytes read from storage per token."""
    return timed_generate(model, tokenizer, tokenizer(spec["prompt"], return_tensors="pt"), spec["new_tokens"])


def run_plain(spec: dict[str, Any]) -> dict[str, Any]:
    """The plain model; with `oracle_trace` (the reference run) it also traces its own sequence
    there, the routing the oracle system reads."""
    from prescient.model_dir import ModelDirectory, model_class

    directory = ModelDirectory.open(spec["model"])
    model = model_class(directory.config).from_pretrained(directory.path).eval()
    tokenizer = directory.tokenizer()
    record = greedy(model, tokenizer, spec)
    record["text"] = tokenizer.decode(record["token_ids"])  # what llama.cpp's text is compared with
    if spec.get("oracle_trace"):
        trace_own_sequence(model, directory, spec, record["token_ids"])
    return record


def trace_own_sequence(model: nn.Module, directory, spec: dict[str, Any], token_ids: list[int]) -> None:
    """Trace the prompt and `token_ids` through `model` into `spec["oracle_trace"]`: one sequence."""
    from prescient.arch import find_moe_layers
    from prescient.fingerprint import loaded_fingerprint
    from prescient.traces import TraceManifest, TraceWriter
    from training.tracing import trace_windows

    tokenizer = directory.tokenizer()
    sequence = tokenizer(spec["prompt"])["input_ids"] + token_ids
    layers = find_moe_layers(model)
    fingerprint = loaded_fingerprint(directory, model, layers, next(model.parameters()).dtype)
    manifest = TraceManifest(fingerprint=fingerprint, dataset="bench-memory prompt", split="reference",
                             top_t=fingerprint.top_k, settings={"model": str(directory.path)})
    writer = TraceWriter(spec["oracle_trace"], manifest)
    trace_windows(model, layers, [sequence], writer, pad_id=tokenizer.pad_token_id or 0, top_t=manifest.top_t,
                  batch_size=1, shard_sequences=1)
    writer.finish()


def run_mmap(spec: dict[str, Any]) -> dict[str, Any]:
    from offload_runtime.engine.mapped import load_mmap_model, mapped_share
    from prescient.model_dir import ModelDirectory

    directory = ModelDirectory.open(spec["model"])
    model, _ = load_mmap_model(directory)
    record = greedy(model, directory.tokenizer(), spec)
    return {**record, "mapped_share": mapped_share(model)}


def run_prescient(spec: dict[str, Any], predictor=None, oracle: bool = False,
                  named: dict[str, Any] | None = None) -> dict[str, Any]:
    """`generate_offloaded` with `--memory`'s default configuration at `spec["memory"]` (None: the
    built-in budget) and `predictor` (the spec's by default; `oracle`: the oracle's settings), with
    the settings `named` as a user names them; the runtime's statistics cover prefill and decode."""
    from dataclasses import replace

    from offload_runtime.engine.options import RuntimeOptions
    from offload_runtime.engine.resolve import resolve_options

    predictor = spec.get("predictor") if predictor is None else predictor
    options = RuntimeOptions() if spec["memory"] is None else \
        resolve_options(spec["model"], None if oracle else predictor, {"memory": spec["memory"], **(named or {})})
    if oracle:
        options = replace(options, **ORACLE_OPTIONS)
    out = generate_offloaded(spec["model"], spec["prompt"], spec["new_tokens"], predictor=predictor, options=options)
    return runtime_record(out)


def runtime_record(out: dict[str, Any]) -> dict[str, Any]:
    """What the memory curve keeps of a `generate_offloaded` record: per decoded token, bytes moved
    and wasted by prefetches, loads, stall; the hash tables' timeliness; the guards' actions."""
    stats, tokens = out["stats"], max(len(out["token_ids"]), 1)
    slot_bytes = stats["slot_bytes"] / max(stats["slots"], 1)
    return {"token_ids": out["token_ids"], "prefill_seconds": out["prefill_seconds"],
            "tokens_per_s": out["tokens_per_s"], "decode_major_faults_per_token": out["decode_major_faults_per_token"],
            "decode_read_bytes_per_token": out["decode_read_bytes_per_token"],
            "settings": out["settings"], "memory_plan": out["memory_plan"],
            "runtime": {"hit_rate": stats["hit_rate"], "bytes_moved_per_token": stats["bytes_moved"] / tokens,
                        "stall_ms_per_token": 1000 * stats["stall_seconds"] / tokens, "slots": stats["slots"],
                        "loads_per_token": stats["loads"] / tokens,
                        "wasted_bytes_per_token": stats["wasted_prefetches"] * slot_bytes / tokens,
                        "tables_on_time": _share(stats["tables_on_time"], stats["late_tables"]),
                        "slot_bytes": stats["slot_bytes"], "stats": stats}}


def run_no_predictor(spec: dict[str, Any]) -> dict[str, Any]:
    return run_prescient({**spec, "predictor": None})


def run_prefetch(spec: dict[str, Any]) -> dict[str, Any]:
    from predictor.registry import read_predictor_meta

    top_k = read_predictor_meta(spec["predictor"]).fingerprint.top_k
    return run_prescient(spec, named={"prefetch_per_layer": top_k})


def run_next(spec: dict[str, Any]) -> dict[str, Any]:
    return run_prescient(spec, named={"next_token_min_chance": NEXT_TOKEN_MIN_CHANCE})


def run_oracle(spec: dict[str, Any]) -> dict[str, Any]:
    from predictor.baselines import OraclePredictor
    from prescient.traces import load_trace

    return run_prescient(spec, OraclePredictor(load_trace(spec["oracle_trace"])), oracle=True)


def _share(on_time: int, late: int) -> float | None:
    return on_time / (on_time + late) if on_time + late else None


RUNNERS = {"plain": run_plain, "mmap": run_mmap, "no-predictor": run_no_predictor, "prescient": run_prescient,
           "prefetch": run_prefetch, "next": run_next, "oracle": run_oracle}
