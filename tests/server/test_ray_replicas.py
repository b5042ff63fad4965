"""`prescient serve --replicas 2` on a local Ray cluster over a tiny Mixtral, driven by the official
`openai` client through Ray's HTTP proxy: completions and chat, streamed and not, equal to one
single-process server's; 401 without the key; both replicas answer, each conversation from one;
/health and /metrics from every replica. Skipped without the extra `[ray]`."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest

from offload_runtime.server.ray_replicas import REPLICA_HEADER
from offload_runtime.server.routing import SESSION_HEADER
from tests.server.serving import MODEL, Running, free_port, serve, serve_process

pytest.importorskip("ray.serve")
pytestmark = pytest.mark.slow

KEY = "replica-test-key"
SETTINGS = ("--policy", "lru", "--budget", "50%", "--max-batch", "4")
PROMPTS = ["def f(x):\n    return", "import os", "class A:\n    def __init__(self):"]
TOKENS = 12


@pytest.fixture(scope="module")
def single(tiny_moe_dir) -> Iterator[Running]:
    with serve(tiny_moe_dir("mixtral"), policy="lru", budget=0.5, max_batch=4, api_keys=(KEY,)) as running:
        yield running


@pytest.fixture(scope="module")
def replicas(tiny_moe_dir) -> Iterator[Running]:
    port = free_port()
    with serve_process(tiny_moe_dir("mixtral"), port, "--replicas", "2", *SETTINGS, env={"PRESCIENT_API_KEY": KEY},
                       ready_s=300, graceful_s=60) as proc:
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # Ray's logs must not fill the pipe
        yield Running(f"http://127.0.0.1:{port}", None, KEY)


def answers(client, prompt: str, stream: bool) -> tuple[str, str]:
    """(completion text, chat text) of greedy requests for `prompt`."""
    kw = {"model": MODEL, "max_tokens": TOKENS, "temperature": 0}
    messages = [{"role": "user", "content": prompt}]
    if not stream:
        text = client.completions.create(prompt=prompt, **kw).choices[0].text
        return text, client.chat.completions.create(messages=messages, **kw).choices[0].message.content
    text = "".join(c.choices[0].text for c in client.completions.create(prompt=prompt, stream=True, **kw) if c.choices)
    reply = "".join(c.choices[0].delta.content or "" for c in
                    client.chat.completions.create(messages=messages, stream=True, **kw) if c.choices)
    return text, reply


@pytest.mark.parametrize("stream", [False, True])
def test_answers_equal_one_server(replicas, single, stream):
    for prompt in PROMPTS:
        assert answers(replicas.client, prompt, stream) == answers(single.client, prompt, stream)


def test_without_the_key_is_401(replicas):
    response = httpx.post(f"{replicas.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1})
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


def test_both_replicas_answer_and_a_session_stays_on_one(replicas):
    def replica_of(session: str) -> str:
        raw = replicas.client.completions.with_raw_response.create(
            model=MODEL, prompt="import os", max_tokens=2, temperature=0, extra_headers={SESSION_HEADER: session})
        return raw.headers[REPLICA_HEADER]

    seen = {session: replica_of(session) for session in (f"s{n}" for n in range(8))}
    assert len(set(seen.values())) == 2
    assert all(replica_of(session) == replica for session, replica in list(seen.items())[:3])


def test_health_and_metrics_come_from_every_replica(replicas):
    health = httpx.get(f"{replicas.url}/health")
    assert health.status_code == 200 and health.json() == {"status": "ok", "replicas": 2}
    samples = replicas.metrics()
    ready = [name for name in samples if name.startswith("prescient_ready{")]
    assert len(ready) == 2 and all('replica="' in name for name in ready)
    assert replicas.metric("prescient_completion_tokens_total") > 0
