"""API keys: the official `openai` client with a right key gets completions, with a wrong one or none a
401 in OpenAI's error shape, on every /v1 route, before the body is read; /health stays open, /metrics
by a flag; several keys; a warning when serving beyond loopback without one."""

from __future__ import annotations

import logging

import httpx
import openai
import pytest

from offload_runtime.server import run_server
from prescient.errors import ModelFilesError
from tests.server.serving import MODEL, free_port, serve

KEYS = ("sk-first-key", "sk-second-key")
V1 = [("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2}),
      ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                        "max_tokens": 2}),
      ("GET", "/v1/models", None)]


@pytest.fixture(scope="module")
def keyed_server(tiny_moe_dir):
    with serve(tiny_moe_dir("mixtral"), budget=0.5, api_keys=KEYS) as running:
        yield running


def test_each_key_gets_completions_from_the_openai_client(keyed_server):
    for key in KEYS:
        answer = keyed_server.client_with(key).completions.create(model=MODEL, prompt="def f(x):", max_tokens=3,
                                                                  temperature=0)
        assert answer.usage.completion_tokens == 3
    assert [m.id for m in keyed_server.client.models.list()] == [MODEL]


@pytest.mark.parametrize("key", ["sk-wrong", KEYS[0] + "x", KEYS[0][:-1], KEYS[1].upper()])
def test_a_wrong_key_is_refused_with_openais_401(keyed_server, key):
    with pytest.raises(openai.AuthenticationError) as refused:
        keyed_server.client_with(key).completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert refused.value.status_code == 401
    assert refused.value.body == {"message": "incorrect API key provided", "type": "invalid_request_error",
                                  "param": None, "code": "invalid_api_key"}


@pytest.mark.parametrize("method, path, body", V1)
@pytest.mark.parametrize("authorization", [None, "", "Bearer", "Basic c2stZmlyc3Qta2V5", KEYS[0],
                                           f"Token {KEYS[0]}"])
def test_every_v1_route_wants_a_bearer_key(keyed_server, method, path, body, authorization):
    headers = {} if authorization is None else {"Authorization": authorization}
    answer = httpx.request(method, keyed_server.url + path, json=body, headers=headers)
    assert answer.status_code == 401 and answer.headers["www-authenticate"] == "Bearer"
    assert answer.json()["error"]["code"] == "invalid_api_key"
    assert "no API key given" in answer.json()["error"]["message"]
    good = httpx.request(method, keyed_server.url + path, json=body, headers={"Authorization": f"bearer {KEYS[1]}"},
                         timeout=60)
    assert good.status_code == 200


def test_a_strangers_body_is_refused_before_it_is_parsed(keyed_server):
    for body in (b"{not json", b"\xff\xfe"):  # a 400 with a key
        answer = httpx.post(f"{keyed_server.url}/v1/completions", content=body,
                            headers={"Content-Type": "application/json"})
        assert answer.status_code == 401


def test_health_and_metrics_stay_open_by_default(keyed_server):
    assert httpx.get(f"{keyed_server.url}/health").status_code == 200
    assert "prescient_requests_total" in httpx.get(f"{keyed_server.url}/metrics").text


def test_metrics_behind_the_key_by_a_flag(tiny_moe_dir):
    with serve(tiny_moe_dir("mixtral"), budget=0.5, api_keys=KEYS[:1], metrics_need_key=True) as running:
        assert httpx.get(f"{running.url}/metrics").status_code == 401
        answer = httpx.get(f"{running.url}/metrics", headers={"Authorization": f"Bearer {KEYS[0]}"})
        assert answer.status_code == 200 and "prescient_requests_total" in answer.text
        assert httpx.get(f"{running.url}/health").status_code == 200


@pytest.mark.parametrize("host, keys, warned", [("0.0.0.0", (), True), ("0.0.0.0", KEYS, False),
                                                ("127.0.0.1", (), False), ("localhost", (), False)])
def test_serving_beyond_loopback_without_a_key_warns(tmp_path, caplog, host, keys, warned):
    (tmp_path / "no-model").mkdir()  # the model fails to load, which stops the server at once
    with caplog.at_level(logging.WARNING, logger="offload_runtime.server.app"), pytest.raises(ModelFilesError):
        run_server(host=host, port=free_port(), log_level="critical", model_dir=tmp_path / "no-model", api_keys=keys)
    warnings = [r.getMessage() for r in caplog.records if "with no API key" in r.getMessage()]
    assert len(warnings) == warned
