"""vLLM's request extensions that load generators and harnesses send (guidellm: `ignore_eos`,
`stream_options.continuous_usage_stats`; `min_tokens`), and the real `max_model_len` on
/v1/models, also before the model has loaded. `ignore_eos` and `min_tokens` are checked on the
scheduler itself over the plain model, with its first greedy token taken as the end of text."""

from __future__ import annotations

import json
import threading

import httpx
import torch

from offload_runtime.server.scheduler import Event, Request, SamplingParams, Scheduler
from offload_runtime.server.service import ServeConfig, Service
from offload_runtime.server.text import TextStream
from prescient.loading import load_model, load_tokenizer
from tests.server.serving import MODEL

CONTEXT = 256  # the tiny models' max_position_embeddings


def stream_events(server, endpoint: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.url}/v1/{endpoint}", json={"model": MODEL, **body}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_guidellms_requests_are_served_with_usage_on_every_chunk(tiny_server):
    """The bodies guidellm 0.8.1's openai_http backend sends for a fixed output length."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    completion = {"prompt": "def f(x):", "max_tokens": 16, "stop": None, "ignore_eos": True, "stream": True,
                  "stream_options": options}
    chat = {"messages": [{"role": "user", "content": "sort a list"}], "max_completion_tokens": 16, "stop": None,
            "ignore_eos": True, "stream": True, "stream_options": options}
    tokens0 = tiny_server.metric("prescient_completion_tokens_total")
    for endpoint, body in (("completions", completion), ("chat/completions", chat)):
        events = stream_events(tiny_server, endpoint, body)
        chunks, last = events[:-1], events[-1]
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 16
        assert [c["usage"]["completion_tokens"] for c in chunks] == [*range(1, 17), 16]
        assert all(c["usage"]["prompt_tokens"] == last["usage"]["prompt_tokens"] for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert tiny_server.metric("prescient_completion_tokens_total") == tokens0 + 32


def test_models_report_the_context_also_before_loading(tiny_server, tiny_moe_dir):
    cards = httpx.get(f"{tiny_server.url}/v1/models").json()["data"]
    assert [(c["id"], c["max_model_len"]) for c in cards] == [(MODEL, CONTEXT)]
    assert Service(ServeConfig(tiny_moe_dir("mixtral"))).context_length == CONTEXT  # not started


def run(scheduler: Scheduler, tokenizer, prompt_ids: list[int], **params) -> tuple[list[int], str]:
    """(tokens, finish reason) of one request through `scheduler`."""
    done, events = threading.Event(), []

    def on_event(event: Event) -> None:
        events.append(event)
        if event.finish_reason is not None:
            done.set()

    request = Request(prompt_ids, SamplingParams(temperature=0.0, **params), on_event,
                      TextStream(tokenizer, params.get("stop", ())))
    scheduler.submit(request)
    assert done.wait(60)
    return request.output_ids, events[-1].finish_reason


def test_ignore_eos_and_min_tokens(tiny_moe_dir):
    path = tiny_moe_dir("mixtral")
    model, _ = load_model(path, dtype=torch.float32)
    tokenizer = load_tokenizer(path)
    prompt = tokenizer("def f(x):")["input_ids"]
    greedy = Scheduler(model, eos_token_ids=set())
    try:
        free, _ = run(greedy, tokenizer, prompt, max_tokens=6)
        # a stop string in the first tokens' text ends the request, unless it ends within min_tokens
        stop = tokenizer.decode(free[:2], skip_special_tokens=True)[-2:]
        assert run(greedy, tokenizer, prompt, max_tokens=6, stop=(stop,))[1] == "stop"
        assert run(greedy, tokenizer, prompt, max_tokens=6, stop=(stop,), min_tokens=4) == (free, "length")
    finally:
        greedy.close()
    eos = free[0]  # the first greedy token, taken as the end of text
    scheduler = Scheduler(model, eos_token_ids={eos})
    try:
        assert run(scheduler, tokenizer, prompt, max_tokens=6) == ([eos], "stop")
        assert run(scheduler, tokenizer, prompt, max_tokens=6, ignore_eos=True) == (free, "length")
        tokens, _ = run(scheduler, tokenizer, prompt, max_tokens=6, min_tokens=3)
        assert eos not in tokens[:3] and len(tokens) >= 3
    finally:
        scheduler.close()


def test_any_number_of_stop_strings_as_vllm(tiny_server):
    """lm-eval adds the end-of-text string to a task's own `until` (code tasks have 5): more than
    OpenAI's 4 stop strings are served, and the first one met ends the answer."""
    body = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 16, "temperature": 0}
    text = httpx.post(f"{tiny_server.url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    stops = ["\x00never", "\x01never", "\x02never", "\x03never", "\x04never", text[3:5]]
    r = httpx.post(f"{tiny_server.url}/v1/completions", json={**body, "stop": stops}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == text[:text.index(text[3:5])]
