"""Load test of `prescient serve`: concurrent clients against a real server process on localhost.

For each server setting (a predictor or none) and each repeat, a server process starts (`cli.serve`,
one torch thread, an API key of its own), takes one warm-up request, then serves each concurrency
level in turn: C clients of the official `openai` client, each sending streamed completions (prompts of the corpus, token ids, sampled with a
per-request seed) one after another until the level's request count is issued or its time is
up. Every request must end answered (200, all its tokens) or refused (429); anything else —
an error, a broken stream, a client timeout — is counted as lost. Per level: aggregate
throughput (completion tokens / wall time from the first request sent to the last answer),
latency and time to first token (p50, p99), and the runtime's own counters over the level
(scraped from /metrics before and after).

Bounded: at most `max_requests` per level, `level_time_s` per level, `request_timeout_s` per
request; localhost only.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai

from experiments.machine import machine_info
from offload_runtime.engine.options import RuntimeOptions
from prescient.atomic import write_json_atomic

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
API_KEY_ENV = "PRESCIENT_API_KEY"  # where `prescient serve` reads its keys (out of the process list)
_RUNTIME = ("expert_cache_hits_total", "expert_cache_misses_total", "expert_loads_total", "expert_bytes_moved_total",
            "expert_stall_seconds_total", "prefetches_issued_total", "prefetches_used_total",
            "prefetches_wasted_total", "hash_tables_late_total", "hash_tables_on_time_total", "decode_steps_total",
            "completion_tokens_total", "prompt_tokens_total")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metrics(url: str) -> dict[str, float]:
    """The unlabelled totals of the runtime counters (summed over label sets)."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("prescient_"):
            key, value = line.rsplit(" ", 1)
            name = key.split("{")[0].removeprefix("prescient_")
            if name in _RUNTIME:
                out[name] = out.get(name, 0.0) + float(value)
    return out


class ServerProcess:
    """`prescient serve` in a child process behind a fresh API key; `stop()` sends SIGTERM and returns
    its exit status."""

    def __init__(self, model_dir: str, predictor: str | None, options: RuntimeOptions, threads: int,
                 max_batch: int, max_queue: int) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = secrets.token_urlsafe(24)
        args = [sys.executable, "-m", "cli.main", "serve", "--model", model_dir, *serve_flags(options),
                "--port", str(self.port), "--served-model-name", "bench", "--threads", str(threads),
                "--max-batch", str(max_batch), "--max-queue", str(max_queue), "--log-level", "warning"]
        args += ["--predictor", predictor] if predictor else []
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT), API_KEY_ENV: self.api_key}
        self.proc = subprocess.Popen(args, cwd=ROOT, env=env)
        try:
            self._wait_ready(time.monotonic() + 600)
        except BaseException:  # not ready, or stopped meanwhile (SIGTERM, Ctrl-C): the server must not outlive us
            self.stop()
            raise

    def _wait_ready(self, deadline: float) -> None:
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {self.proc.returncode} before it was ready")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not become ready in 600 s")
            time.sleep(0.2)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


async def _one(client: openai.AsyncOpenAI, prompt: list[int], max_tokens: int, seed: int,
               timeout: float) -> dict[str, Any]:
    """One streamed completion; its outcome: answered (all `max_tokens`), refused (429), failed
    (another status, an error event, a broken or short stream) or timed_out."""
    record: dict[str, Any] = {"sent": time.perf_counter(), "status": None, "first_token": None, "tokens": 0}

    async def run() -> str:
        stream = await client.completions.create(model="bench", prompt=prompt, max_tokens=max_tokens,
                                                 temperature=1.0, seed=seed, stream=True)
        record["status"] = 200
        async for chunk in stream:
            choice = chunk.choices[0]
            if choice.finish_reason is None:
                record["first_token"] = record["first_token"] or time.perf_counter()
            else:
                record["tokens"], record["finish_reason"] = chunk.usage.completion_tokens, choice.finish_reason
        # all max_tokens, or fewer ending at the end-of-text token (sampling may draw it)
        complete = (record.get("finish_reason") == "length" and record["tokens"] == max_tokens) or \
            (record.get("finish_reason") == "stop" and 0 < record["tokens"] <= max_tokens)
        return "answered" if complete else "failed"

    try:
        record["outcome"] = await asyncio.wait_for(run(), timeout)
    except asyncio.TimeoutError:
        record["outcome"] = "timed_out"
    except openai.APIStatusError as exc:  # an answer other than 200
        record["status"] = exc.status_code
        record["outcome"] = "refused" if exc.status_code == 429 else "failed"
    except openai.APIError as exc:  # a broken stream, or an error event in it
        record["outcome"], record["error"] = "failed", repr(exc)
    record["done"] = time.perf_counter()
    return record


async def _level(url: str, api_key: str, prompts: list[list[int]], clients: int, requests: int, max_tokens: int,
                 time_limit: float, timeout: float, seed: int) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    issued = iter(range(requests))
    deadline = time.perf_counter() + time_limit
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    http = openai.DefaultAsyncHttpxClient(limits=limits)

    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=timeout,
                                  http_client=http) as client:
        async def worker() -> None:
            for i in issued:
                if time.perf_counter() > deadline:
                    return
                records.append(await _one(client, prompts[i % len(prompts)], max_tokens, seed + i, timeout))

        await asyncio.gather(*(worker() for _ in range(clients)))
    return records


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    answered = [r for r in records if r["outcome"] == "answered"]
    wall = max(r["done"] for r in records) - min(r["sent"] for r in records) if records else 0.0
    tokens = sum(r["tokens"] for r in answered)
    latency = [r["done"] - r["sent"] for r in answered]
    ttft = [r["first_token"] - r["sent"] for r in answered if r["first_token"]]
    outcomes = {k: sum(r["outcome"] == k for r in records) for k in ("answered", "refused", "failed", "timed_out")}
    lost = [{k: r.get(k) for k in ("outcome", "status", "tokens", "finish_reason", "error")}
            for r in records if r["outcome"] in ("failed", "timed_out")]
    return {"requests": len(records), **outcomes, "lost": len(lost), "lost_requests": lost[:10],
            "completion_tokens": tokens, "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 3) if wall else None,
            "latency_s": {"p50": _pct(latency, 0.5), "p99": _pct(latency, 0.99)},
            "ttft_s": {"p50": _pct(ttft, 0.5), "p99": _pct(ttft, 0.99)}}


def serve_flags(options: RuntimeOptions) -> list[str]:
    """`prescient serve`'s flags for `options`; hide-only prefetch and `prefetch_per_layer` have
    none, so a server process cannot take them."""
    if options.link_timing is not None or options.prefetch_per_layer is not None:
        raise ValueError("a `prescient serve` process takes no link timing object nor prefetch_per_layer")
    flags = ["--policy", options.policy, "--budget", str(options.budget), "--store", options.store,
             "--device", options.device, "--transfer-workers", str(options.transfer_workers),
             "--dtype", options.dtype, "--slot-format", options.slot_format]
    flags += ["--drop-page-cache"] if options.drop_page_cache else []
    chance = options.next_token_min_chance
    return flags + (["--next-token", "--next-token-min-chance", str(chance)] if chance is not None else [])


def bench_serve(model_dir: str, json_path: str, plot_path: str | None = None,
                predictors: dict[str, str | None] | None = None, options: RuntimeOptions = RuntimeOptions(),
                clients: tuple[int, ...] = (1, 4, 16, 64), rounds: int = 2, max_requests: int = 64,
                max_tokens: int = 32, prompt_tokens: tuple[int, int] = (16, 48), repeats: int = 3,
                level_time_s: float = 300.0, request_timeout_s: float = 300.0, threads: int = 1,
                max_batch: int = 64, max_queue: int = 64, dataset: str = "stdlib-code",
                split: str = "validation") -> dict[str, Any]:
    """Run the load test with the servers' runtime `options`; write (and return) the JSON after
    every level, and the plot at the end."""
    from experiments.bench_batch import request_prompts
    from prescient.loading import load_tokenizer

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    predictors = predictors or {"none": None}
    prompts = request_prompts(load_tokenizer(model_dir), max_requests, *prompt_tokens, dataset, split)
    result: dict[str, Any] = {
        "settings": {"model": model_dir, "predictors": predictors, **options.to_json(),
                     "clients": list(clients), "rounds": rounds, "max_requests": max_requests,
                     "max_tokens": max_tokens, "prompt_tokens": list(prompt_tokens), "repeats": repeats,
                     "level_time_s": level_time_s, "request_timeout_s": request_timeout_s, "max_batch": max_batch,
                     "max_queue": max_queue, "dataset": f"{dataset}:{split}",
                     "decoding": "sampled, temperature 1, a seed per request", "stream": True},
        "machine": machine_info(threads), "runs": [],
    }
    for repeat in range(repeats):
        for name, predictor in predictors.items():
            server = ServerProcess(model_dir, predictor, options, threads, max_batch, max_queue)
            try:
                asyncio.run(_level(server.url, server.api_key, prompts, 1, 1, max_tokens, level_time_s,
                                   request_timeout_s, 10**6))
                for c in clients:
                    before = _metrics(server.url)
                    requests = min(max_requests, max(c, c * rounds))
                    records = asyncio.run(_level(server.url, server.api_key, prompts, c, requests, max_tokens,
                                                 level_time_s, request_timeout_s, seed=1000 * repeat))
                    after = _metrics(server.url)
                    run = {"repeat": repeat, "predictor": name, "clients": c, **summarize(records),
                           "runtime": {k: round(after.get(k, 0) - before.get(k, 0), 4) for k in _RUNTIME}}
                    result["runs"].append(run)
                    log.info("%s, %d clients (repeat %d): %s tokens/s, %d answered, %d refused, %d lost", name, c,
                             repeat, run["tokens_per_s"], run["answered"], run["refused"], run["lost"])
                    result["summary"] = summary(result)
                    write_json_atomic(json_path, result)
            finally:
                result.setdefault("server_exit_status", []).append(server.stop())
    result["summary"] = summary(result)
    write_json_atomic(json_path, result)
    if plot_path:
        from experiments.bench_serve_plot import plot_bench_serve

        plot_bench_serve(result, plot_path)
    return result


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """Per predictor and client count: median and range of throughput over repeats, and the
    speed-up over one client (per repeat, then the median)."""
    out: dict[str, Any] = {}
    for name in result["settings"]["predictors"]:
        runs = [r for r in result["runs"] if r["predictor"] == name]
        per: dict[str, Any] = {}
        for c in sorted({r["clients"] for r in runs}):
            level = [r for r in runs if r["clients"] == c]
            speed = [r["tokens_per_s"] for r in level if r["tokens_per_s"]]
            ups = []
            for r in level:
                one = next((o for o in runs if o["clients"] == 1 and o["repeat"] == r["repeat"]), None)
                if one and one["tokens_per_s"] and r["tokens_per_s"]:
                    ups.append(r["tokens_per_s"] / one["tokens_per_s"])
            per[str(c)] = {
                "tokens_per_s_median": statistics.median(speed) if speed else None,
                "tokens_per_s_range": [min(speed), max(speed)] if speed else None,
                "speedup_over_1_client_median": round(statistics.median(ups), 3) if ups else None,
                "speedup_range": [round(min(ups), 3), round(max(ups), 3)] if ups else None,
                "latency_p50_s_median": statistics.median([r["latency_s"]["p50"] for r in level
                                                           if r["latency_s"]["p50"] is not None] or [0]),
                "ttft_p50_s_median": statistics.median([r["ttft_s"]["p50"] for r in level
                                                        if r["ttft_s"]["p50"] is not None] or [0]),
                "lost": sum(r["lost"] for r in level), "refused": sum(r["refused"] for r in level),
                "repeats": len(level),
            }
        out[name] = per
    return out
