"""Decode at the memory bus's rate: the experts' bytes a decoded token streams, against what this
machine's memory moves, per experts kernel and torch thread count.

1. The bus: GB/s of a read-only pass (`sum`) and of a copy (read + write) over a tensor far larger
   than the last-level cache, best of a few, at each thread count.
2. The experts alone: one decode token (top-k distinct experts, a new set each call so no expert
   stays in cache) through a MoE layer's real experts module, per kernel ("model": transformers'
   own, grouped_mm by default; "streamed": `expert_kernels.streamed_experts_forward`; "gemv": the
   same with a decode row through `rowdot.product`), ms per layer and GB/s of expert weights read.
3. End to end: the plain model's greedy decode (`generate.timed_generate`) with each kernel,
   tokens/s and the expert GB/s it implies (tokens/s x layers x top-k x bytes per expert), the
   per-token overhead (a decoded token's ms less its layers' experts' ms of step 2: attention,
   routers, Python, dispatch and generate's own work), and per kernel of ours, whether its greedy
   tokens and logits equal transformers' own kernel's (32 tokens).

Repeats are interleaved: each repeat runs every thread count, and at each every kernel (model,
streamed, gemv, and with `--llama-cpp DIR --gguf M.gguf` llama.cpp's `llama-completion` on the same
prompt, memory-mapped, its own "eval time" line's tokens/s and whether its greedy text is the plain
model's); the summary gives medians and spreads. `--dtype bfloat16` measures the half-precision
paths (where "gemv" runs no row kernel: it is "streamed").

    python -m experiments.bench_decode --model runs/tw --json results/bench-decode-tw.json
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

from experiments.bench_batch_shared import median_spread
from experiments.machine import machine_info
from offload_runtime.engine.expert_kernels import GEMV, STREAMED, register_streamed
from prescient.atomic import write_json_atomic

log = logging.getLogger(__name__)

KERNELS = ("model", STREAMED, GEMV)
PROMPT = "def read_config(path):\n    with open(path) as f:\n"


def bus_gb_s(mib: int = 1024, repeats: int = 5) -> dict[str, float]:
    """GB/s of a read-only pass and of a copy over `mib` MiB of float32, best of `repeats`."""
    source = torch.ones(mib * 2**20 // 4)
    target = torch.empty_like(source)
    best = {"read": float("inf"), "copy": float("inf")}
    for _ in range(repeats):
        for name, call in (("read", source.sum), ("copy", lambda: target.copy_(source))):
            start = time.perf_counter()
            call()
            best[name] = min(best[name], time.perf_counter() - start)
    return {"read_gb_s": source.nbytes / best["read"] / 1e9, "copy_gb_s": 2 * source.nbytes / best["copy"] / 1e9}


def expert_bytes(layer) -> int:
    """Bytes of one expert's weights in `layer`'s experts module."""
    return sum(p[0].numel() * p.element_size() for p in layer.experts.parameters())


@torch.inference_mode()
def experts_ms(layer, calls: int) -> float:
    """Median ms of one decode token through `layer`'s experts module, a new set of top-k experts
    each call (cycling through them all), after a warm-up pass over every expert."""
    experts, k = layer.num_experts, layer.top_k
    hidden = torch.randn(1, layer.experts.hidden_dim if hasattr(layer.experts, "hidden_dim") else
                         layer.experts.gate_up_proj.shape[-1])
    dtype = next(layer.experts.parameters()).dtype
    hidden, weights = hidden.to(dtype), torch.full((1, k), 1.0 / k, dtype=dtype)
    ids = [torch.tensor([[(i * k + j) % experts for j in range(k)]]) for i in range(max(calls, experts))]
    for index in ids[:experts]:
        layer.experts(hidden, index, weights)
    times = []
    for index in ids[:calls]:
        start = time.perf_counter()
        layer.experts(hidden, index, weights)
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[len(times) // 2]


def greedy(model, ids: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=model.config.pad_token_id)
    return out.sequences, torch.stack(out.logits)


def exactness(model, ids: torch.Tensor, new_tokens: int, own: str, kernels: tuple[str, ...] = KERNELS
              ) -> dict[str, Any]:
    """Per kernel of ours, greedy tokens and every step's logits against transformers' `own` kernel's."""
    model.set_experts_implementation(own)
    want_tokens, want_logits = greedy(model, ids, new_tokens)
    checks = {}
    for kernel in (k for k in kernels if k != "model"):
        model.set_experts_implementation(kernel)
        tokens, logits = greedy(model, ids, new_tokens)
        checks[kernel] = {"tokens_equal": bool(torch.equal(tokens, want_tokens)),
                          "logits_equal": bool(torch.equal(logits, want_logits)),
                          "max_logit_difference": float((logits - want_logits).abs().max())}
    return checks


def run_once(model, layers, tokenizer, inputs, kernel: str, own: str, new_tokens: int, calls: int) -> dict[str, Any]:
    from offload_runtime.engine.generate import timed_generate

    model.set_experts_implementation(own if kernel == "model" else kernel)
    per_token = len(layers) * layers[0].top_k * expert_bytes(layers[0])
    layer_ms = experts_ms(layers[0], calls)
    tokens_per_s = timed_generate(model, tokenizer, inputs, new_tokens)["tokens_per_s"]
    return {"kernel": kernel, "experts_ms_per_layer": layer_ms,
            "experts_gb_s": layers[0].top_k * expert_bytes(layers[0]) / layer_ms / 1e6,
            "decode_tokens_per_s": tokens_per_s, "decode_experts_gb_s": tokens_per_s * per_token / 1e9,
            "outside_experts_ms_per_token": 1e3 / tokens_per_s - len(layers) * layer_ms}


def bench_decode(model_dir: str, json_path: str, threads: list[int], repeats: int = 3, new_tokens: int = 96,
                 calls: int = 40, command: str | None = None, kernels: tuple[str, ...] = KERNELS,
                 dtype: str = "float32", llama: dict[str, str] | None = None) -> dict[str, Any]:
    """See the module doc."""
    from experiments.bench_kernels import own_memory
    from prescient.loading import load_model, load_tokenizer

    register_streamed()
    model, layers = load_model(model_dir, dtype=getattr(torch, dtype))
    own_memory(model)
    own = model.config._experts_implementation
    tokenizer = load_tokenizer(model_dir)
    inputs = tokenizer(PROMPT, return_tensors="pt")
    result: dict[str, Any] = {
        "command": command, "machine": machine_info(torch.get_num_threads()),
        "settings": {"model": model_dir, "threads": threads, "repeats": repeats, "new_tokens": new_tokens,
                     "kernels": list(kernels), "dtype": dtype, "llama_cpp": llama,
                     "model_experts_implementation": own, "expert_bytes": expert_bytes(layers[0]),
                     "moe_layers": len(layers), "top_k": layers[0].top_k, "prompt": PROMPT},
        "exactness": exactness(model, inputs.input_ids, min(new_tokens, 32), own, kernels),
        "bus": {str(count): bus_at(count) for count in threads}, "runs": []}
    columns = (*kernels, *(("llama.cpp",) if llama else ()))
    for repeat in range(repeats):  # thread counts and kernels interleaved within each repeat
        for count in threads:
            torch.set_num_threads(count)
            for kernel in columns:
                run = (run_llama(llama, new_tokens, count) if kernel == "llama.cpp" else
                       run_once(model, layers, tokenizer, inputs, kernel, own, new_tokens, calls))
                run.update(threads=count, repeat=repeat)
                result["runs"].append(run)
                log.info("%d thread(s) %s: %s", count, kernel, {k: round(v, 2) for k, v in run.items()
                                                                if isinstance(v, float)})
                write_json_atomic(Path(json_path), result)
    if llama:
        result["exactness"]["llama.cpp"] = llama_text_check(model, tokenizer, inputs, result["runs"], new_tokens)
    result["summary"] = {f"{count} thread(s)": {kernel: {key: median_spread(
        [r[key] for r in result["runs"] if r["threads"] == count and r["kernel"] == kernel])
        for key in ("experts_ms_per_layer", "experts_gb_s", "decode_tokens_per_s", "decode_experts_gb_s",
                    "outside_experts_ms_per_token")
        if all(key in r for r in result["runs"] if r["kernel"] == kernel)}
        for kernel in columns} for count in threads}
    write_json_atomic(Path(json_path), result)
    return result


def bus_at(count: int) -> dict[str, float]:
    torch.set_num_threads(count)
    return bus_gb_s()


def run_llama(llama: dict[str, str], new_tokens: int, count: int) -> dict[str, Any]:
    """llama.cpp's `llama-completion` on the GGUF, memory-mapped, `count` threads, the same prompt."""
    from experiments.bench_memory.llama_cpp import run_llama_cpp

    out = run_llama_cpp({**llama, "prompt": PROMPT, "new_tokens": new_tokens, "threads": count})
    return {"kernel": "llama.cpp", "decode_tokens_per_s": out["tokens_per_s"], "text": out["text"]}


def llama_text_check(model, tokenizer, inputs, runs: list[dict[str, Any]], new_tokens: int) -> dict[str, Any]:
    """Whether llama.cpp's greedy text is the plain model's (transformers' own kernel) in every run,
    as far as both go (`bench_memory.orchestrate.same_greedy`), and whole."""
    from experiments.bench_memory.orchestrate import same_greedy

    model.set_experts_implementation(model.config._experts_implementation)
    tokens, _ = greedy(model, inputs.input_ids, new_tokens)
    want = tokenizer.decode(tokens[0, inputs.input_ids.shape[1]:].tolist())
    texts = [r["text"] for r in runs if r["kernel"] == "llama.cpp"]
    return {"same_text": all(same_greedy({"text": text}, {"text": want}) for text in texts),
            "text_equal": all(text == want for text in texts), "runs": len(texts)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--json", required=True, help="results file (rewritten after every run)")
    p.add_argument("--threads", default="1,2", help="torch thread counts, comma-separated (interleaved)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every thread count and kernel")
    p.add_argument("--new-tokens", type=int, default=96, help="greedy tokens per decode run")
    p.add_argument("--kernels", default=",".join(KERNELS), help=f"comma list of {', '.join(KERNELS)}")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--llama-cpp", metavar="BIN_DIR", help="also llama.cpp's llama-completion from this folder")
    p.add_argument("--gguf", help="with --llama-cpp: the model as GGUF")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    llama = None
    if args.llama_cpp:
        from experiments.bench_memory.llama_cpp import binary_path, check_gguf

        llama = {"llama_cpp": str(binary_path(args.llama_cpp).parent), "gguf": str(check_gguf(args.gguf))}
    result = bench_decode(args.model, args.json, [int(t) for t in args.threads.split(",")], args.repeats,
                          args.new_tokens, command=shlex.join(["python", "-m", "experiments.bench_decode",
                                                               *(argv or sys.argv[1:])]),
                          kernels=tuple(args.kernels.split(",")), dtype=args.dtype, llama=llama)
    for label, kernels in result["summary"].items():
        print(label + ": " + "; ".join(
            f"{kernel} decode {row['decode_tokens_per_s']['median']:.1f} tok/s "
            f"({row['decode_tokens_per_s']['min']:.1f}-{row['decode_tokens_per_s']['max']:.1f})"
            + (f", {row['outside_experts_ms_per_token']['median']:.2f} ms a token outside the experts"
               if "outside_experts_ms_per_token" in row else "")
            for kernel, row in kernels.items()) + f"; bus {result['bus'][label.split()[0]]}")
    print(f"against {result['settings']['model_experts_implementation']}: {result['exactness']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
