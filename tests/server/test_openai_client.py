"""The official `openai` client against the real server over a tiny Mixtral with half its
experts offloaded: completions and chat, streamed and not; greedy output equals the plain
transformers model run on each prompt alone, also when requests share decode batches; seeded
sampling does not depend on the batch; /metrics moves with the requests."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from offload_runtime.server.text import DEFAULT_CHAT_TEMPLATE
from predictor import FrequencyPredictor, PredictorMeta, save_predictor
from prescient.fingerprint import fingerprint_model
from prescient.loading import load_model, load_tokenizer
from tests.server.serving import MODEL, serve

PROMPTS = ["def f(x):\n    return", "The cache keeps the experts that the router will choose next",
           "import os", "class A:\n    def __init__(self):", "x = [1, 2, 3]\nfor i in x:", "# a comment",
           "while True:\n    break", "return self.cache[key]"]
TOKENS = 24


@pytest.fixture(scope="module")
def reference(tiny_moe_dir):
    """Greedy continuation (text, token count) of a prompt by the plain model, the prompt alone."""
    path = tiny_moe_dir("mixtral")
    plain, _ = load_model(path, dtype=torch.float32)
    tokenizer = load_tokenizer(path)
    done: dict[tuple[str, int], tuple[str, int]] = {}

    def continuation(prompt: str, tokens: int = TOKENS) -> tuple[str, int]:
        if (prompt, tokens) not in done:
            inputs = tokenizer(prompt, return_tensors="pt")
            with torch.inference_mode():
                out = plain.generate(**inputs, max_new_tokens=tokens, do_sample=False,
                                     pad_token_id=tokenizer.pad_token_id)
            new = out[0, inputs["input_ids"].shape[1]:]
            done[(prompt, tokens)] = tokenizer.decode(new, skip_special_tokens=True), len(new)
        return done[(prompt, tokens)]

    return continuation


def complete(client, prompt: str, stream: bool, **kw) -> tuple[str, int, str, int]:
    """(text, completion tokens, finish reason, chunks carrying a token) of one completion."""
    kw = {"model": MODEL, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, **kw}
    if not stream:
        r = client.completions.create(**kw)
        return r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason, 0
    text, chunks, finish, usage = "", 0, None, None
    for chunk in client.completions.create(stream=True, **kw):
        if chunk.choices[0].finish_reason is None:
            chunks += 1
            text += chunk.choices[0].text
        else:
            finish, usage = chunk.choices[0].finish_reason, chunk.usage
            text += chunk.choices[0].text
    return text, usage.completion_tokens, finish, chunks


def test_completion_equals_plain_model(tiny_server, reference):
    text, tokens, finish, _ = complete(tiny_server.client, PROMPTS[0], stream=False)
    assert (text, tokens) == reference(PROMPTS[0])
    assert finish == "length"


def test_streaming_sends_one_chunk_per_token_and_the_same_text(tiny_server, reference):
    text, tokens, finish, chunks = complete(tiny_server.client, PROMPTS[1], stream=True)
    assert (text, tokens) == reference(PROMPTS[1])
    assert chunks == tokens and finish == "length"


def test_concurrent_requests_share_batches_and_each_equals_the_plain_model(tiny_server, reference):
    before = tiny_server.metrics()
    jobs = [(prompt, stream) for prompt in PROMPTS for stream in (False, True)]  # 16 requests, batches of 8
    start = threading.Barrier(len(jobs))

    def run(job):
        start.wait()
        return complete(tiny_server.client, job[0], stream=job[1])

    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(run, jobs))
    for (prompt, _stream), (text, tokens, _finish, _chunks) in zip(jobs, results):
        assert (text, tokens) == reference(prompt), prompt
    after = tiny_server.metrics()
    key = next(k for k in after if k.startswith("prescient_decode_steps_total"))
    rows = sum(r[1] for r in results)
    steps = after[key] - before.get(key, 0)
    assert steps < rows / 2, "the requests were not decoded together"  # alone: one step per token


def test_chat_uses_the_default_template(tiny_server, reference, tiny_moe_dir):
    messages = [{"role": "system", "content": "Answer in code."}, {"role": "user", "content": "sort a list"}]
    tokenizer = load_tokenizer(tiny_moe_dir("mixtral"))
    assert not tokenizer.chat_template  # the tiny tokenizer has none: the documented default applies
    prompt = tokenizer.apply_chat_template(messages, chat_template=DEFAULT_CHAT_TEMPLATE, tokenize=False,
                                           add_generation_prompt=True)
    assert prompt == "system: Answer in code.\nuser: sort a list\nassistant:"
    r = tiny_server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=TOKENS, temperature=0)
    assert (r.choices[0].message.content, r.usage.completion_tokens) == reference(prompt)
    assert r.choices[0].message.role == "assistant" and r.usage.prompt_tokens == len(tokenizer(prompt)["input_ids"])
    streamed = tiny_server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=TOKENS,
                                                          temperature=0, stream=True,
                                                          stream_options={"include_usage": True})
    chunks = list(streamed)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_stop_string_cuts_the_text(tiny_server, reference):
    full, _ = reference(PROMPTS[2])
    stop = full[5:8]
    assert stop and full.find(stop) >= 0
    for stream in (False, True):
        text, tokens, finish, _ = complete(tiny_server.client, PROMPTS[2], stream=stream, stop=[stop])
        assert text == full[:full.find(stop)] and finish == "stop" and tokens < TOKENS


def test_seeded_sampling_does_not_depend_on_the_batch(tiny_server):
    kw = {"temperature": 1.0, "top_p": 0.9, "seed": 1234}
    alone = complete(tiny_server.client, PROMPTS[3], stream=False, **kw)
    with ThreadPoolExecutor(6) as pool:  # the same request beside others with other seeds
        futures = [pool.submit(complete, tiny_server.client, PROMPTS[3], False, **kw)] + \
                  [pool.submit(complete, tiny_server.client, PROMPTS[3], False, temperature=1.0, seed=s)
                   for s in range(5)]
        results = [f.result() for f in futures]
    assert results[0] == alone
    assert len({r[0] for r in results}) > 1  # other seeds sample other text


def test_metrics_move_with_requests(tiny_server, reference):
    labels = {"policy": "lru", "budget": "0.5", "predictor": "none"}
    before = tiny_server.metrics()
    m = tiny_server.metric
    length0, tokens0 = m("prescient_requests_total", finish_reason="length", **labels), \
        m("prescient_completion_tokens_total", **labels)
    accesses0 = m("prescient_expert_cache_hits_total") + m("prescient_expert_cache_misses_total")
    ttft0, prompt0 = m("prescient_time_to_first_token_seconds_count"), m("prescient_prompt_tokens_total")
    text, tokens, _, _ = complete(tiny_server.client, PROMPTS[4], stream=False)
    assert m("prescient_requests_total", finish_reason="length", **labels) == length0 + 1
    assert m("prescient_completion_tokens_total", **labels) == tokens0 + tokens
    assert m("prescient_time_to_first_token_seconds_count") == ttft0 + 1
    assert m("prescient_prompt_tokens_total") > prompt0
    assert m("prescient_expert_cache_hits_total") + m("prescient_expert_cache_misses_total") > accesses0
    assert m("prescient_expert_loads_total") > 0 and m("prescient_expert_bytes_moved_total") > 0
    assert m("prescient_expert_slots") == 8  # half of 2 layers x 8 experts
    assert m("prescient_tokens_per_second") > 0 and m("prescient_ready") == 1
    assert before  # the scrape before the request parsed


def test_models_and_health(tiny_server):
    assert [m.id for m in tiny_server.client.models.list().data] == [MODEL]


def frequency_artifact(model_dir, tmp_path, cls=FrequencyPredictor):
    model, layers = load_model(model_dir, dtype=torch.float32)
    fingerprint = fingerprint_model(model, layers)
    counts = torch.arange(fingerprint.n_moe_layers * fingerprint.n_experts, dtype=torch.float32)
    predictor = cls(counts.reshape(fingerprint.n_moe_layers, fingerprint.n_experts),
                    PredictorMeta(cls.kind, fingerprint))
    return predictor, save_predictor(predictor, tmp_path / "frequency")


def test_predictor_prefetches_while_serving_and_output_is_unchanged(tiny_moe_dir, tmp_path, reference):
    _, artifact = frequency_artifact(tiny_moe_dir("mixtral"), tmp_path)
    with serve(tiny_moe_dir("mixtral"), predictor=artifact, policy="lru", budget=0.5) as running:
        # one request at a time: a batch of rows predicts more experts per layer than 8 slots hold
        results = [complete(running.client, p, stream=False) for p in PROMPTS[:4]]
        for prompt, (text, tokens, _, _) in zip(PROMPTS, results):
            assert (text, tokens) == reference(prompt)
        assert running.metric("prescient_prefetches_issued_total", predictor="frequency") > 0
        assert running.metric("prescient_hash_tables_on_time_total") + \
            running.metric("prescient_hash_tables_late_total") > 0


def test_a_memory_that_holds_every_expert_serves_the_plain_model_batched(tiny_moe_dir, reference):
    with serve(tiny_moe_dir("mixtral"), memory="16GiB", max_batch=4) as running:
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda p: complete(running.client, p, stream=False), PROMPTS[:4]))
        for prompt, (text, tokens, _, _) in zip(PROMPTS, results):
            assert (text, tokens) == reference(prompt)
        assert running.metric("prescient_expert_slots", policy="none") == 2 * 8  # every expert of the 2 x 8 resident
        assert running.metric("prescient_model_forwards_total") > 0
        exported = {key.partition("{")[0] for key in running.metrics()}
        assert not {"prescient_expert_cache_hit_rate", "prescient_expert_cache_hits_total"} & exported  # no cache runs
