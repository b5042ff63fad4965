"""The expert hit rate of serving replicas under a multi-turn chat workload, by routing.

Workload: `conversations` chats about as many standard-library files (the test split: files the
reference models never trained on), each `turns` turns; a turn's user message is the next chunk of
its file, and every request resends the whole conversation so far (as chat clients do), answered
greedily. All conversations run at once, each sending its next turn when the last is answered
(closed loop). Settings, each from cold caches: one server; `replicas` replicas routed at random;
routed by the least loaded; routed cache-aware (`offload_runtime.server.routing`: a conversation
stays on the replica whose cache holds its experts unless that replica is busy). Per setting: the
expert-cache hits and misses summed over the replicas (from /metrics), the hit rate, wall time,
and every answer, which must equal the single server's.

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


def hits_and_misses(texts: list[str]) -> tuple[float, float]:
    """The expert-cache hits and misses in /metrics expositions, summed over every replica."""
    totals = {"prescient_expert_cache_hits_total": 0.0, "prescient_expert_cache_misses_total": 0.0}
    for text in texts:
        for line in text.splitlines():
            name = line.split("{")[0].split(" ")[0]
            if name in totals:
                totals[name] += float(line.rsplit(" ", 1)[1])
    return totals["prescient_expert_cache_hits_total"], totals["prescient_expert_cache_misses_total"]


class InProcess:
    """`replicas` apps in this process, routed as the Ray router would route them."""

    def __init__(self, app_args: dict, replicas: int, mode: str, busy_at: int, seed: int = 0) -> None:
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
    of each turn, and the hits and misses the workload added."""
    before = hits_and_misses(await backend.metrics())
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
    hits, misses = (after - first for after, first in zip(hits_and_misses(await backend.metrics()), before))
    return {"hits": hits, "misses": misses, "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
            "wall_s": round(wall, 2), "replica_of_turn": placed, "answers": answers}


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


def _backend(kind: str, setting: str, app_args: dict, replicas: int, busy_at: int, port: int | None):
    count, mode = (1, "least-loaded") if setting == "single" else (replicas, setting)
    if kind == "ray":
        return OnRay(app_args, count, mode, busy_at, port)
    return InProcess(app_args, count, mode, busy_at)


def bench_replicas(app_args: dict, json_path: str, backend: str = "inprocess", replicas: int = 2,
                   conversations: int = 8, turns: int = 4, max_tokens: int = 24, busy_at: int | None = None,
                   settings: tuple[str, ...] = SETTINGS, port: int = 8000, threads: int = 1) -> dict[str, Any]:
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
    runs: dict[str, Any] = {}
    try:
        for setting in settings:
            log.info("%s: %s", setting, "loading")
            started = time.perf_counter()
            server = _backend(backend, setting, app_args, replicas, busy_at, port)
            ready_s = round(time.perf_counter() - started, 1)
            runs[setting] = {**asyncio.run(_measure(server, chats, max_tokens)), "ready_s": ready_s}
            log.info("%s: hit rate %.4f", setting, runs[setting]["hit_rate"])
    finally:
        if backend == "ray":
            serve.shutdown()
            ray.shutdown()
    result = {"settings": {"backend": backend, "replicas": replicas, "conversations": conversations, "turns": turns,
                           "max_tokens": max_tokens, "busy_at": busy_at, "model_dir": str(app_args["model_dir"]),
                           "predictor": str(app_args.get("predictor")), "options": app_args["options"].to_json()},
              "machine": machine_info(threads), "runs": runs, "summary": summary(runs)}
    write_json_atomic(json_path, result)
    return result


def summary(runs: dict[str, Any]) -> dict[str, Any]:
    """Hit rates, cache-aware routing's against the others, and whether every answer equals the single server's."""
    rates = {name: round(run["hit_rate"], 4) for name, run in runs.items()}
    out: dict[str, Any] = {"hit_rate": rates}
    if "cache" in rates:
        out["cache_over"] = {name: round(rates["cache"] / rate, 3) if rate else None
                             for name, rate in rates.items() if name != "cache"}
    if "single" in runs:
        out["answers_equal_single"] = {name: run["answers"] == runs["single"]["answers"]
                                       for name, run in runs.items() if name != "single"}
    return out
