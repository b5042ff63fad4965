"""Lifecycle: `prescient serve` in its own process stops on SIGTERM and Ctrl-C (SIGINT) after
letting the in-flight request finish, and exits 0; a client that disconnects frees its place in
the batch at once; a crash of the hash-building thread is counted and serving goes on."""

from __future__ import annotations

import json
import signal
import threading

import httpx
import pytest
import torch

from predictor import FrequencyPredictor, PredictorMeta
from prescient.fingerprint import fingerprint_model
from prescient.loading import load_model
from tests.server.serving import MODEL, free_port, serve, serve_process, wait_until


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)],  # one handler
                         ids=["SIGTERM", "SIGINT"])
def test_signal_lets_the_running_request_finish_then_exits_0(tiny_moe_dir, sig):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with serve_process(tiny_moe_dir("mixtral"), port, "--shutdown-timeout", "60") as proc:
        lines = []
        body = {"model": MODEL, "prompt": "x", "max_tokens": 250, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as stream:
            for line in stream.iter_lines():
                if not line:  # the blank line between events
                    continue
                lines.append(line)
                if len(lines) == 3:  # once: a second Ctrl-C is uvicorn's "force exit"
                    proc.send_signal(sig)  # mid-stream
        assert lines[-1] == "data: [DONE]"
        final = json.loads(lines[-2][len("data: "):])
        assert final["choices"][0]["finish_reason"] == "length" and final["usage"]["completion_tokens"] == 250
        assert len(lines) == 250 + 2  # a chunk per token, the finish chunk, [DONE]
        assert proc.wait(60) == 0
        output = proc.stdout.read()
        assert "Finished server process" in output and "Traceback" not in output
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/health")


def test_client_that_disconnects_frees_its_slot(tiny_server):
    cancelled = tiny_server.metric("prescient_requests_total", finish_reason="cancelled")
    tokens = tiny_server.metric("prescient_completion_tokens_total")
    body = {"model": MODEL, "prompt": "x", "max_tokens": 250, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{tiny_server.url}/v1/completions", json=body, timeout=60) as stream:
        for i, _line in enumerate(stream.iter_lines()):
            if i == 4:
                break  # leaving the block closes the connection mid-stream
    wait_until(lambda: tiny_server.metric("prescient_requests_total", finish_reason="cancelled") == cancelled + 1)
    assert tiny_server.metric("prescient_requests_running") == 0
    assert tiny_server.metric("prescient_completion_tokens_total") - tokens < 250  # it did not run to the end
    # a non-streaming request whose client gives up
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{tiny_server.url}/v1/completions", json={**body, "stream": False}, timeout=0.1)
    wait_until(lambda: tiny_server.metric("prescient_requests_total", finish_reason="cancelled") == cancelled + 2)
    assert tiny_server.metric("prescient_requests_running") == 0


class ExplodingPredictor(FrequencyPredictor):
    """Raises once it has predicted `calls_left` tokens (over every sequence)."""

    calls_left = 10

    def step(self, state, token_ids: torch.Tensor) -> torch.Tensor:
        ExplodingPredictor.calls_left -= 1
        if ExplodingPredictor.calls_left < 0:
            raise ValueError("predictor exploded")
        return super().step(state, token_ids)


def test_hash_builder_crash_is_counted_and_serving_goes_on(tiny_moe_dir):
    model, layers = load_model(tiny_moe_dir("mixtral"), dtype=torch.float32)
    fingerprint = fingerprint_model(model, layers)
    predictor = ExplodingPredictor(torch.ones(fingerprint.n_moe_layers, fingerprint.n_experts),
                                   PredictorMeta("frequency", fingerprint))
    # no prediction guard: on a tiny model it would put the predictor to sleep before its 10th step
    with serve(tiny_moe_dir("mixtral"), predictor=predictor, budget=0.5, prediction_guard=False) as running:
        body = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 20, "temperature": 0}
        answers = [httpx.post(f"{running.url}/v1/completions", json=body, timeout=60) for _ in range(3)]
        assert [a.status_code for a in answers] == [200] * 3
        assert len({a.json()["choices"][0]["text"] for a in answers}) == 1
        assert all(a.json()["usage"]["completion_tokens"] == 20 for a in answers)
        assert running.metric("prescient_hash_builder_failures_total") == 1
        assert not [t for t in threading.enumerate() if t.name == "hash-builder"]  # stopped, not hung
        assert running.metric("prescient_requests_total", finish_reason="error") == 0
