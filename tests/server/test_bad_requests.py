"""What a client can get wrong, and a full queue: each a 4xx with OpenAI's error body, and the
server answers the next request as before. A predictor of another model stops the server from
starting, with both fingerprints in the message."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from offload_runtime.server import run_server
from predictor import FrequencyPredictor, PredictorMeta, save_predictor
from prescient.errors import FingerprintMismatchError
from prescient.fingerprint import fingerprint_model
from prescient.loading import load_model
from tests.server.serving import MODEL, free_port, serve

OK = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 4, "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
LONG_PROMPT = "x = 1\n" * 200  # over the tiny model's 256-token context

BAD = [  # (endpoint, body, status, error param or None, words in the message)
    ("completions", b'{"model": "tiny", "prompt": ', 400, None, "not valid JSON"),
    ("completions", {**OK, "model": "gpt-4"}, 404, "model", "does not exist"),
    ("completions", {**OK, "max_tokens": 0}, 400, "max_tokens", "at least 1"),
    ("completions", {**OK, "max_tokens": -3}, 400, "max_tokens", "at least 1"),
    ("completions", {**OK, "max_tokens": 300}, 400, "max_tokens", "past the model's context"),
    ("completions", {**OK, "prompt": LONG_PROMPT}, 400, "prompt", "context"),
    ("completions", {**OK, "prompt": ""}, 400, "prompt", "empty"),
    ("completions", {**OK, "max_tokens": "four"}, 400, "max_tokens", "integer"),
    ("completions", {**OK, "temperature": "hot"}, 400, "temperature", ""),
    ("completions", {**OK, "stop": 7}, 400, "stop", ""),
    ("completions", {**OK, "best_guess": True}, 400, "best_guess", "Unrecognized request argument"),
    ("completions", {**OK, "n": 2}, 400, "n", "n = 1"),
    ("completions", {**OK, "prompt": [1, 2, 10**6]}, 400, "prompt", "token ids"),
    ("completions", {**OK, "prompt": [[]]}, 400, "prompt", "the prompt is empty"),  # an empty list of token ids
    ("completions", {**OK, "prompt": [[]], "echo": True, "max_tokens": 0, "logprobs": 1}, 400, "prompt", "empty"),
    ("completions", {**OK, "prompt": []}, 400, "prompt", "the prompt is empty"),
    ("completions", {**OK, "seed": 2**70}, 400, "seed", "less than 18446744073709551616"),
    ("chat/completions", {**CHAT, "seed": -2**70}, 400, "seed", "greater than or equal to"),
    ("completions", {"prompt": "x"}, 400, "model", "Field required"),
    ("chat/completions", {**CHAT, "messages": []}, 400, "messages", "at least 1"),
    ("chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role", ""),
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": LONG_PROMPT}]}, 400, "messages",
     "context"),
    ("chat/completions", {**CHAT, "max_completion_tokens": 0, "max_tokens": None}, 400, "max_completion_tokens",
     "at least 1"),
    ("chat/completions", {**CHAT, "logprobs": True}, 400, "logprobs", "not supported"),
    ("completions", {**OK, "logprobs": 21}, 400, "logprobs", "less than or equal to 20"),
    ("completions", {**OK, "logprobs": True}, 400, "logprobs", "integer"),
    ("completions", {**OK, "prompt": [[1, 2], [3]]}, 400, "prompt", "one prompt per request"),
    ("completions", {**OK, "min_tokens": 8}, 400, "min_tokens", "more than max_tokens"),
    ("completions", {**OK, "min_tokens": -1}, 400, "min_tokens", "greater than or equal to 0"),
    ("completions", {**OK, "top_k": 5}, 400, "top_k", "Unrecognized request argument"),
    ("completions", {**OK, "stream_options": {"include_usage": True, "bogus": 1}}, 400, "stream_options.bogus", "Unrecognized"),
]


@pytest.mark.parametrize(("endpoint", "body", "status", "param", "words"), BAD,
                         ids=[f"{i}-{b[0]}-{b[3]}" for i, b in enumerate(BAD)])
def test_bad_request_is_a_4xx_with_an_openai_error_and_serving_goes_on(tiny_server, endpoint, body, status, param,
                                                                       words):
    url = f"{tiny_server.url}/v1/{endpoint}"
    r = httpx.post(url, content=body, headers={"content-type": "application/json"}) if isinstance(body, bytes) \
        else httpx.post(url, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert words in error["message"] and error["param"] == param and error["type"] == "invalid_request_error"
    again = httpx.post(f"{tiny_server.url}/v1/completions", json=OK, timeout=60)
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 4


def test_full_queue_is_429_with_retry_after_and_nothing_is_lost(tiny_moe_dir):
    with serve(tiny_moe_dir("mixtral"), max_batch=1, max_queue=1) as running:
        start = threading.Barrier(8)

        def post(_):
            start.wait()
            return httpx.post(f"{running.url}/v1/completions", json={**OK, "max_tokens": 120}, timeout=120)

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(post, range(8)))
        refused = [r for r in answers if r.status_code == 429]
        served = [r for r in answers if r.status_code == 200]
        assert len(refused) + len(served) == 8 and len(refused) >= 1 and len(served) >= 2
        for r in refused:
            assert r.headers["Retry-After"] == "1" and r.json()["error"]["code"] == "queue_full"
        for r in served:
            assert r.json()["usage"]["completion_tokens"] == 120
        assert running.metric("prescient_requests_rejected_total") == len(refused)
        assert running.metric("prescient_requests_total", finish_reason="length") == len(served)


def test_predictor_of_another_model_refuses_to_start(tiny_moe_dir, tmp_path):
    olmoe, layers = load_model(tiny_moe_dir("olmoe"), dtype=torch.float32)
    other = fingerprint_model(olmoe, layers)
    artifact = save_predictor(FrequencyPredictor(torch.ones(other.n_moe_layers, other.n_experts),
                                                 PredictorMeta("frequency", other)), tmp_path / "olmoe-frequency")
    mixtral, layers = load_model(tiny_moe_dir("mixtral"), dtype=torch.float32)
    this = fingerprint_model(mixtral, layers)
    with pytest.raises(FingerprintMismatchError) as raised:
        run_server(port=free_port(), log_level="warning", model_dir=tiny_moe_dir("mixtral"), predictor=artifact)
    assert str(this) in str(raised.value) and str(other) in str(raised.value)
