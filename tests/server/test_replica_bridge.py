"""A Ray replica's bridge to the server app, without Ray: `Replica.forward` runs a request through
the real app in process and hands back its ASGI messages (the start, tagged with the replica, then
the body: whole, or a server-sent event per token); `Replica.get` (what the gateway broadcasts for
/health and /metrics) returns a GET whole."""

from __future__ import annotations

import asyncio
import json

from offload_runtime.server.ray_replicas import REPLICA_HEADER, Replica
from tests.server.serving import MODEL

HEADERS = [(b"content-type", b"application/json")]


class Borrowed(Replica):
    """A replica over the module's already loaded test server, which it must not close when collected."""

    def __init__(self, app) -> None:  # what Replica's constructor makes, without Ray and a load of its own
        self.app, self.name = app, "r0"

    def __del__(self) -> None:
        pass


def replica_over(running) -> Replica:
    return Borrowed(running.app)


def forward(replica: Replica, body: dict) -> list[dict]:
    async def collect() -> list[dict]:
        return [m async for m in replica.forward(None, "POST", "/v1/completions", b"", HEADERS,
                                                 json.dumps(body).encode())]
    return asyncio.run(collect())


def test_a_whole_answer_is_the_start_then_one_body(tiny_server):
    messages = forward(replica_over(tiny_server), {"model": MODEL, "prompt": "import os", "max_tokens": 4,
                                                   "temperature": 0})
    start, *bodies = messages
    assert start["status"] == 200 and (REPLICA_HEADER.encode(), b"r0") in start["headers"]
    assert len(bodies) == 1 and not bodies[0].get("more_body", False)
    assert json.loads(bodies[0]["body"])["usage"]["completion_tokens"] == 4


def test_a_stream_is_an_event_per_token_then_done(tiny_server):
    messages = forward(replica_over(tiny_server), {"model": MODEL, "prompt": "import os", "max_tokens": 4,
                                                   "temperature": 0, "stream": True})
    text = b"".join(m.get("body", b"") for m in messages[1:]).decode()
    assert text.count("data: ") == 4 + 1 + 1 and text.endswith("data: [DONE]\n\n")  # tokens, finish, [DONE]


def test_get_returns_health_and_metrics_whole(tiny_server):
    replica = replica_over(tiny_server)
    status, _headers, body = asyncio.run(replica.get("/health", []))
    assert status == 200 and json.loads(body) == {"status": "ok"}
    status, _headers, body = asyncio.run(replica.get("/metrics", []))
    assert status == 200 and b"prescient_ready" in body
