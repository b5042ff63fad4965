"""The expert hit rate of serving replicas under a multi-turn chat workload, by routing.

Workload: `conversations` chats about as many standard-library files (the test split: files the
reference models never trained on), each `turns` turns; a turn's user message is the next chunk of
its file, and every request resends the whole conversation so far (as chat clients do), answered
greedily. All conversations run at once, each sending its next turn when the last is answered
(closed loop). Settings, each from cold caches: one server; `replicas` replicas routed at random;
routed by the least loaded; routed cache-aware (`offload_runtime.server.routing`: a conversation
stays on the replica whose cache holds its experts unless that replica is busy). Per setting: the
expert-cache hits and misses summed over the replicas (from /metrics), the hit rate, the prefills'
share of them, the prompt tokens prefilled (with a prefix cache, those it did not hold), tokens/s,
wall time, and every answer, which must equal the single server's. `repeats` runs every setting
that many times, interleaved (single, random, ..., single, random, ...); the summary gives medians
and ranges.

Two backends run the same workload and routing code: `ray` deploys `ray_replicas` on a local Ray
cluster (Ray's HTTP proxy, the gateway, the custom request router); `inprocess` serves each replica's
ASGI app in this process and routes with `routing.rank_replicas` directly (no Ray: the fallback
where a Ray cluster is too heavy for the machine).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from experiments.machine import machine_info
from offload_runtime.server.routing import rank_replicas, routing_key
from prescient.atomic import write_json_atomic
from training.corpora import split_of, stdlib_files

log = logging.getLogger(__name__)

MODEL = "served"
SETTINGS = ("single", "random", "least-loaded", "cache")


def workload(conversations: int, turns: int, first_chars: int = 400, turn_chars: int = 200) -> list[list[str]]:
    """Each conversation's user messages: consecutive chunks of one test-split stdlib file."""
    files = [f for f in stdlib_files() if split_of(str(f.name)) == "test" and f.stat().st_size > 4000]
    if len(files) < conversations:
        raise ValueError(f"only {len(files)} standard-library files to make {conversations} conversations of")
    step = len(files) // conversations
    out = []
    for path in files[::step][:conversations]:
        text = path.read_text(encoding="utf-8", errors="replace")
        chunks = [text[:first_chars]]
        chunks += [text[first_chars + n * turn_chars:first_chars + (n + 1) * turn_chars] for n in range(turns - 1)]
        out.append(chunks)
    return out


COUNTED = ("expert_cache_hits", "expert_cache_misses", "prefill_expert_cache_hits", "prefill_expert_cache_misses",
           "prompt_tokens", "prompt_tokens_cached", "completion_tokens")


def counts(texts: list[str]) -> dict[str, float]:
    """The `COUNTED` counters in /metrics expositions, each summed over every replica."""
    totals = dict.fromkeys(COUNTED, 0.0)
    for text in texts:
        for line in text.splitlines():
            name = line.split("{")[0].split(" ")[0].removeprefix("prescient_").removesuffix("_total")
            if name in totals and not line.startswith("#"):
                totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


class InProcess:
    """`replicas` apps in this process, routed as the Ray router would route them."""

    def __init__(self, app_args: dict, replicas: int, mode: str, busy_at: int, seed: int) -> None:
        from offload_runtime.server.app import create_app

        self.apps = [create_app(**app_args, served_model_name=MODEL, replica=f"r{n}") for n in range(replicas)]
        for app in self.apps:  # one after another, as separate processes would not race in one
            app.state.service.start()
            if not app.state.service.wait_loaded():
                raise app.state.service.load_error
        self.names = [f"r{n}" for n in range(replicas)]
        self.load = dict.fromkeys(self.names, 0)
        self.mode, self.busy_at, self.rng = mode, busy_at, random.Random(seed)
        self.clients = [httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://replica", timeout=600)
                        for app in self.apps]

    async def post(self, body: dict) -> tuple[str, dict]:
        raw = json.dumps(body).encode()
        ranks = rank_replicas(routing_key({}, raw), self.names, self.load, self.busy_at, self.mode, self.rng)
        name = min(ranks[0], key=lambda n: self.load[n])  # Ray's choice within a rank: the least loaded
        self.load[name] += 1
        try:
            response = await self.clients[self.names.index(name)].post(
                "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        finally:
            self.load[name] -= 1
        return name, response.raise_for_status().json()

    async def metrics(self) -> list[str]:
        return [(await client.get("/metrics")).text for client in self.clients]

    async def close(self) -> None:
        for client, app in zip(self.clients, self.apps):
            await client.aclose()
            await asyncio.to_thread(app.state.service.close)


class OnRay:
    """`ray_replicas` deployed on the Ray cluster this process joined, reached through Ray's proxy."""

    def __init__(self, app_args: dict, replicas: int, mode: str, busy_at: int, port: int) -> None:
        from ray import serve

        from offload_runtime.server.ray_replicas import APP_NAME, replicas_app

        self.serve, self.name = serve, APP_NAME
        app = replicas_app({**app_args, "served_model_name": MODEL}, replicas, mode, busy_at=busy_at, threads=1)
        serve.run(app, name=APP_NAME, route_prefix="/")
        self.client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600)

    async def post(self, body: dict) -> tuple[str, dict]:
        from offload_runtime.server.ray_replicas import REPLICA_HEADER

        response = await self.client.post("/v1/chat/completions", json=body)
        return response.headers.get(REPLICA_HEADER, "?"), response.raise_for_status().json()

    async def metrics(self) -> list[str]:
        return [(await self.client.get("/metrics")).text]

    @staticmethod
    def memory() -> dict[str, float]:
        """Resident MiB of each replica process, and of the rest of Ray (proxy, controller, gateway, raylet, GCS)."""
        import psutil

        replicas, rest = [], 0.0
        for proc in psutil.process_iter(["cmdline", "memory_info"]):
            line = " ".join(proc.info["cmdline"] or ())
            mib = proc.info["memory_info"].rss / 2**20 if proc.info["memory_info"] else 0.0
            if "ServeReplica:prescient:replica" in line:
                replicas.append(round(mib, 1))
            elif "ray::" in line or "raylet" in line or "gcs_server" in line:
                rest += mib
        return {"replica_rss_mib": sorted(replicas), "ray_other_rss_mib": round(rest, 1)}

    async def close(self) -> None:
        await self.client.aclose()
        await asyncio.to_thread(self.serve.delete, self.name)


async def run_conversations(backend, chats: list[list[str]], max_tokens: int) -> dict[str, Any]:
    """Every conversation at once, each turn after the last is answered; the answers, the replica
    of each turn, and what the workload added to the counters."""
    before = counts(await backend.metrics())
    answers: list[list[str]] = [[] for _ in chats]
    placed: list[list[str]] = [[] for _ in chats]

    async def converse(n: int) -> None:
        messages = []
        for user in chats[n]:
            messages.append({"role": "user", "content": user})
            replica, body = await backend.post({"model": MODEL, "messages": messages, "max_tokens": max_tokens,
                                                "temperature": 0})
            reply = body["choices"][0]["message"]["content"]
            messages.append({"role": "assistant", "content": reply})
            answers[n].append(reply)
            placed[n].append(replica)

    start = time.perf_counter()
    await asyncio.gather(*(converse(n) for n in range(len(chats))))
    wall = time.perf_counter() - start
    c = {name: value - before[name] for name, value in counts(await backend.metrics()).items()}
    hits, misses = c["expert_cache_hits"], c["expert_cache_misses"]
    prefill = c["prefill_expert_cache_hits"] + c["prefill_expert_cache_misses"]
    decode_hits = hits - c["prefill_expert_cache_hits"]
    return {"hits": hits, "misses": misses, "hit_rate": _ratio(hits, hits + misses),
            "prefill_accesses": prefill, "prefill_hits": c["prefill_expert_cache_hits"],
            "decode_hit_rate": _ratio(decode_hits, hits + misses - prefill),
            "prompt_tokens": c["prompt_tokens"], "prefill_tokens": c["prompt_tokens"] - c["prompt_tokens_cached"],
            "completion_tokens": c["completion_tokens"], "tokens_per_s": round(c["completion_tokens"] / wall, 2),
            "wall_s": round(wall, 2), "replica_of_turn": placed, "answers": answers}


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


async def _measure(server, chats: list[list[str]], max_tokens: int) -> dict[str, Any]:
    """The workload on one setting's servers, then their memory (on Ray), then closed (in the loop
    whose connections they hold)."""
    try:
        run = await run_conversations(server, chats, max_tokens)
        if isinstance(server, OnRay):
            run["memory"] = server.memory()
        return run
    finally:
        await server.close()


def _backend(kind: str, setting: str, app_args: dict, replicas: int, busy_at: int, port: int | None, seed: int):
    count, mode = (1, "least-loaded") if setting == "single" else (replicas, setting)
    if kind == "ray":
        return OnRay(app_args, count, mode, busy_at, port)
    return InProcess(app_args, count, mode, busy_at, seed)


def bench_replicas(app_args: dict, json_path: str, backend: str = "inprocess", replicas: int = 2,
                   conversations: int = 8, turns: int = 4, max_tokens: int = 24, busy_at: int | None = None,
                   settings: tuple[str, ...] = SETTINGS, port: int = 8000, threads: int = 1,
                   repeats: int = 1) -> dict[str, Any]:
    """Run the workload under each setting (see the module's docstring); write and return the JSON."""
    import torch

    torch.set_num_threads(threads)  # the in-process replicas' (each Ray replica sets its own: 1)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    chats = workload(conversations, turns)
    busy_at = busy_at or app_args.get("max_batch", 16)
    if backend == "ray":
        import ray
        from ray import serve

        ray.init(include_dashboard=False, log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": port})
    runs: dict[str, list[dict[str, Any]]] = {setting: [] for setting in settings}
    try:
        for repeat, setting in ((r, s) for r in range(repeats) for s in settings):
            log.info("%s, repeat %d: loading", setting, repeat)
            started = time.perf_counter()
            server = _backend(backend, setting, app_args, replicas, busy_at, port, seed=repeat)
            ready_s = round(time.perf_counter() - started, 1)
            runs[setting].append({**asyncio.run(_measure(server, chats, max_tokens)), "ready_s": ready_s})
            log.info("%s: hit rate %.4f", setting, runs[setting][-1]["hit_rate"])
    finally:
        if backend == "ray":
            serve.shutdown()
            ray.shutdown()
    result = {"settings": {"backend": backend, "replicas": replicas, "conversations": conversations, "turns": turns,
                           "max_tokens": max_tokens, "busy_at": busy_at, "repeats": repeats,
                           "prefix_cache_bytes": app_args.get("prefix_cache_bytes", 0),
                           "model_dir": str(app_args["model_dir"]),
                           "predictor": str(app_args.get("predictor")), "options": app_args["options"].to_json()},
              "machine": machine_info(threads), "runs": runs, "summary": summary(runs)}
    write_json_atomic(json_path, result)
    return result


SUMMED = ("hit_rate", "decode_hit_rate", "prefill_share", "prefill_tokens", "tokens_per_s")


def summary(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per setting, the median and range over repeats of `SUMMED`; cache-aware routing's median
    hit rate against the others' (and the range of the ratio within each repeat); and whether
    every answer equals the single server's."""
    def values(run: dict[str, Any]) -> dict[str, float]:
        return {**{k: run[k] for k in SUMMED if k in run},
                "prefill_share": _ratio(run["prefill_accesses"], run["hits"] + run["misses"])}

    table = {name: [values(run) for run in repeats] for name, repeats in runs.items()}
    out: dict[str, Any] = {
        "median": {k: {name: round(statistics.median(v[k] for v in rows), 4) for name, rows in table.items()}
                   for k in SUMMED},
        "range": {k: {name: [round(min(v[k] for v in rows), 4), round(max(v[k] for v in rows), 4)]
                      for name, rows in table.items()} for k in SUMMED}}
    rates = out["hit_rate"] = out["median"]["hit_rate"]
    if "cache" in rates:
        out["cache_over"] = {name: round(rates["cache"] / rate, 3) if rate else None
                             for name, rate in rates.items() if name != "cache"}
        out["cache_over_range"] = {
            name: [round(min(ratios), 3), round(max(ratios), 3)]
            for name in rates if name != "cache"
            if (ratios := [c["hit_rate"] / o["hit_rate"] for c, o in zip(runs["cache"], runs[name]) if o["hit_rate"]])}
    if "single" in runs:
        first = runs["single"][0]["answers"]
        out["answers_equal_single"] = {name: all(run["answers"] == first for run in repeats)
                                       for name, repeats in runs.items()}
    return out
