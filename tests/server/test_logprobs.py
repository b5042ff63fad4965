"""Completions with `logprobs` and `echo` against the real server over a tiny Mixtral with half its
experts offloaded: every token's logprob and its top candidates equal the plain transformers
model's log-softmax in float32 (to 1e-5), for the prompt (`echo`) and the generated tokens,
whole and streamed, alone and sharing batches with other requests; `max_tokens` 0 with `echo`
scores the prompt only, as lm-evaluation-harness's loglikelihood requests ask."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from prescient.loading import load_model, load_tokenizer
from tests.server.serving import MODEL

PROMPTS = ["def f(x):\n    return", "The cache keeps the experts", "import os", "class A:\n    def"]
TOL = 1e-5


@pytest.fixture(scope="module")
def plain(tiny_moe_dir):
    """(model, tokenizer) of the plain transformers model in float32."""
    path = tiny_moe_dir("mixtral")
    model, _ = load_model(path, dtype=torch.float32)
    return model, load_tokenizer(path)


def greedy_ids(plain, prompt_ids: list[int], tokens: int) -> list[int]:
    model, tokenizer = plain
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             max_new_tokens=tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return out[0, len(prompt_ids):].tolist()


def expected_logprobs(plain, ids: list[int], first: int, top: int) -> tuple[list[float], list[dict[str, float]]]:
    """Each token's log-softmax from ids[first:] on, given the ones before it, and its top `top`
    (by token text, the token itself added), from one plain forward over `ids`."""
    model, tokenizer = plain
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    chosen, tops = [], []
    for i in range(max(first, 1), len(ids)):
        chosen.append(float(logprobs[i - 1, ids[i]]))
        values, best = logprobs[i - 1].topk(top)
        candidates = {tokenizer.decode([t]): float(v) for t, v in zip(best.tolist(), values.tolist())}
        candidates.setdefault(tokenizer.decode([ids[i]]), chosen[-1])
        tops.append(candidates)
    return chosen, tops


def assert_close(got: dict, chosen: list[float], tops: list[dict[str, float]]) -> None:
    assert got["token_logprobs"] == pytest.approx(chosen, abs=TOL)
    assert len(got["top_logprobs"]) == len(tops)
    for have, want in zip(got["top_logprobs"], tops):
        assert have.keys() == want.keys() and list(have.values()) == pytest.approx(list(want.values()), abs=TOL)


def post(server, **body) -> dict:
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "temperature": 0, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def check_echo(server, plain, prompt: str, tokens: int = 6, top: int = 3) -> dict:
    """An echo completion with logprobs, checked token by token against the plain model."""
    model, tokenizer = plain
    prompt_ids = tokenizer(prompt)["input_ids"]
    answer = post(server, prompt=prompt, max_tokens=tokens, logprobs=top, echo=True)
    choice, out = answer["choices"][0], greedy_ids(plain, prompt_ids, tokens)
    ids = prompt_ids + out
    assert choice["text"] == prompt + tokenizer.decode(out, skip_special_tokens=True)
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [tokenizer.decode([t]) for t in ids]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert_close({k: v[1:] for k, v in logprobs.items()}, *expected_logprobs(plain, ids, 1, top))
    offsets = [sum(len(t) for t in logprobs["tokens"][:i]) for i in range(len(ids))]
    assert logprobs["text_offset"] == offsets
    assert answer["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": tokens,
                               "total_tokens": len(ids)}
    return answer


def test_echo_with_logprobs_equals_the_plain_models_log_softmax(tiny_server, plain):
    check_echo(tiny_server, plain, PROMPTS[0])


def test_logprobs_without_echo_cover_the_generated_tokens_only(tiny_server, plain):
    _, tokenizer = plain
    prompt_ids = tokenizer(PROMPTS[1])["input_ids"]
    choice = post(tiny_server, prompt=PROMPTS[1], max_tokens=5, logprobs=2)["choices"][0]
    out = greedy_ids(plain, prompt_ids, 5)
    assert choice["text"] == tokenizer.decode(out, skip_special_tokens=True)
    assert_close(choice["logprobs"], *expected_logprobs(plain, prompt_ids + out, len(prompt_ids), 2))
    zero = post(tiny_server, prompt=PROMPTS[1], max_tokens=5, logprobs=0)["choices"][0]["logprobs"]
    assert [list(t) for t in zero["top_logprobs"]] == [[t] for t in zero["tokens"]]  # the token itself only


def test_max_tokens_0_with_echo_scores_the_prompt_as_lm_eval_asks(tiny_server, plain):
    _, tokenizer = plain
    ids = tokenizer(PROMPTS[2] + " and more text to score")["input_ids"]
    answer = post(tiny_server, prompt=[ids], max_tokens=0, logprobs=1, echo=True)  # lm-eval's batch of one
    choice = answer["choices"][0]
    assert choice["text"] == tokenizer.decode(ids, skip_special_tokens=True) and choice["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 0 and len(choice["logprobs"]["tokens"]) == len(ids)
    chosen, tops = expected_logprobs(plain, ids, 1, 1)
    assert_close({k: v[1:] for k, v in choice["logprobs"].items()}, chosen, tops)
    # lm-eval's own request (max_tokens 1) and how it reads it: the context's continuation, [ctxlen:-1]
    ctxlen = 3
    lm_eval = post(tiny_server, prompt=[ids], max_tokens=1, logprobs=1, echo=True, seed=1234)["choices"][0]
    scored = lm_eval["logprobs"]["token_logprobs"][ctxlen:-1]
    assert sum(scored) == pytest.approx(sum(chosen[ctxlen - 1:]), abs=TOL * len(scored))
    assert len(lm_eval["logprobs"]["tokens"]) == len(ids) + 1


def test_streamed_logprobs_and_echo_equal_the_whole_answer(tiny_server, plain):
    whole = check_echo(tiny_server, plain, PROMPTS[3])["choices"][0]
    body = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 6, "logprobs": 3, "echo": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", f"{tiny_server.url}/v1/completions", json=body, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    chunks = [e for e in events if e["choices"]]
    assert chunks[0]["choices"][0]["text"] == PROMPTS[3]  # the echo first
    merged = {key: [x for c in chunks if c["choices"][0]["logprobs"] for x in c["choices"][0]["logprobs"][key]]
              for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    assert merged["tokens"] == whole["logprobs"]["tokens"]
    assert merged["token_logprobs"][0] is None
    assert merged["token_logprobs"][1:] == pytest.approx(whole["logprobs"]["token_logprobs"][1:], abs=TOL)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    # continuous usage: on every chunk, the completion tokens so far; then a usage chunk of its own
    assert [c["usage"]["completion_tokens"] for c in chunks] == [0, 1, 2, 3, 4, 5, 6, 6]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 6


def test_requests_with_logprobs_share_batches_with_others(tiny_server, plain):
    _, tokenizer = plain
    before = tiny_server.metrics()
    jobs = [(prompt, top) for prompt in PROMPTS for top in (None, 2)]
    start = threading.Barrier(len(jobs))

    def run(job):
        start.wait()
        extra = {} if job[1] is None else {"logprobs": job[1], "echo": True}
        return post(tiny_server, prompt=job[0], max_tokens=12, **extra)["choices"][0]

    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(run, jobs))
    for (prompt, top), choice in zip(jobs, results):
        prompt_ids = tokenizer(prompt)["input_ids"]
        out = greedy_ids(plain, prompt_ids, 12)
        assert choice["text"] == ("" if top is None else prompt) + tokenizer.decode(out, skip_special_tokens=True)
        if top is not None:
            chosen, tops = expected_logprobs(plain, prompt_ids + out, 1, top)
            assert_close({k: v[1:] for k, v in choice["logprobs"].items()}, chosen, tops)
    after = tiny_server.metrics()
    key = next(k for k in after if k.startswith("prescient_decode_steps_total"))
    assert after[key] - before.get(key, 0) < len(jobs) * 12 / 2, "the requests were not decoded together"
