"""The prefix KV cache: its bookkeeping; a prefill that resumes cached prefixes (rows of different
pasts, and a fresh row, in one forward) gives the logits a whole-prompt prefill gives; and a server
with the cache answers multi-turn chats token for token as one without it, prefilling fewer tokens."""

from __future__ import annotations

import concurrent.futures

import httpx
import torch
from transformers.cache_utils import DynamicCache

from offload_runtime.engine.memory_plan import MemoryPlanner, Reserves
from offload_runtime.engine.options import RuntimeOptions
from offload_runtime.server.kv_batch import KVBatch, prefill_inputs
from offload_runtime.server.prefix_cache import Prefix, PrefixCache
from prescient.loading import load_model
from prescient.model_dir import ModelDirectory
from tests.server.serving import MODEL, serve


def prefix(tokens: list[int], width: int = 4) -> Prefix:
    """A one-layer prefix of `tokens` with `width` floats per token in keys and in values."""
    kv = torch.arange(len(tokens) * width, dtype=torch.float32).reshape(1, len(tokens), width)
    return Prefix(tuple(tokens), (kv,), (kv.clone(),))


def test_lookup_takes_the_longest_common_prefix_and_leaves_a_token_to_prefill():
    cache = PrefixCache(max_bytes=10**6)
    cache.store(prefix([1, 2, 3, 4]))
    cache.store(prefix([1, 2, 9]))
    hit = cache.lookup([1, 2, 3, 7, 8])
    assert hit.tokens == (1, 2, 3) and hit.keys[0].shape == (1, 3, 4)
    assert torch.equal(hit.keys[0], prefix([1, 2, 3, 4]).keys[0][:, :3])
    assert cache.lookup([1, 2, 3, 4]).tokens == (1, 2, 3)  # the last prompt token is always prefilled
    assert cache.lookup([5, 1, 2]) is None
    assert cache.lookup([1]) is None


def test_a_sequence_replaces_the_entries_it_extends_and_the_bounds_drop_the_least_recent():
    cache = PrefixCache(max_bytes=10**6, max_entries=2)
    cache.store(prefix([1, 2]))
    cache.store(prefix([1, 2, 3, 4]))  # the next turn of the same conversation
    assert len(cache) == 1 and cache.bytes == prefix([1, 2, 3, 4]).nbytes
    cache.store(prefix([7, 8]))
    cache.lookup([1, 2, 3, 4, 5])  # [1, 2, 3, 4] is now the most recent
    cache.store(prefix([9, 9]))
    assert cache.lookup([7, 8, 0]) is None and cache.lookup([1, 2, 3, 4, 5]) is not None
    small = PrefixCache(max_bytes=prefix([1, 2, 3]).nbytes)
    small.store(prefix([1, 2, 3, 4]))  # larger than the whole bound: not kept
    assert len(small) == 0 and small.bytes == 0
    small.store(prefix([1, 2]))
    small.store(prefix([5, 6]))
    assert len(small) == 1 and small.lookup([5, 6, 7]) is not None


def test_a_prefill_resuming_cached_prefixes_gives_the_whole_prompts_logits(tiny_moe_dir):
    model, _ = load_model(tiny_moe_dir("mixtral"), dtype=torch.float32)
    prompts = [list(range(5, 30)), list(range(40, 52)), list(range(60, 69))]
    cut = [17, 4, 0]  # tokens each row resumes from the cache (0: a fresh row)
    with torch.inference_mode():
        full = [model(input_ids=torch.tensor([p])).logits[0, -1] for p in prompts]
        pasts = []
        for prompt, n in zip(prompts, cut):
            if not n:
                pasts.append(None)
                continue
            cache = DynamicCache(config=model.config)
            model(input_ids=torch.tensor([prompt[:n]]), cache=cache, use_cache=True)
            pasts.append(KVBatch(cache, torch.ones(1, n, dtype=torch.bool)).row(0, prompt))
        assert [len(p.tokens) for p in pasts if p] == [17, 4]
        ids, valid, positions, cache = prefill_inputs([p[n:] for p, n in zip(prompts, cut)], pasts, 1, model.config)
        assert valid.shape == (3, 17 + 9) and valid.sum(1).tolist() == [25, 12, 9]
        assert positions[:, -1].tolist() == [24, 11, 8]
        logits = model(input_ids=ids, attention_mask=valid.long(), position_ids=positions, cache=cache,
                       use_cache=True).logits[:, -1]
    for row in range(3):
        torch.testing.assert_close(logits[row], full[row], atol=1e-4, rtol=1e-4)
        assert int(logits[row].argmax()) == int(full[row].argmax())


def chat(url: str, turns: list[str], max_tokens: int = 8) -> list[str]:
    messages, answers = [], []
    for user in turns:
        messages.append({"role": "user", "content": user})
        body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
        answers.append(answer["choices"][0]["message"]["content"])
        messages.append({"role": "assistant", "content": answers[-1]})
    return answers


def test_a_server_with_the_prefix_cache_answers_as_one_without(tiny_moe_dir):
    chats = [[f"def f{n}(x): return x + {n}", "and now sort a list", "explain the cache"] for n in range(3)]
    scored = {"model": MODEL, "prompt": "def f0(x): return x + 0 and more", "max_tokens": 0, "echo": True,
              "logprobs": 2}
    answers = {}
    for cached in (0, 2**20):
        with serve(tiny_moe_dir("mixtral"), policy="lru", budget=0.5, max_batch=8,
                   prefix_cache_bytes=cached) as server:
            with concurrent.futures.ThreadPoolExecutor(len(chats)) as pool:  # turns of different chats batch together
                answers[cached] = list(pool.map(lambda turns: chat(server.url, turns), chats))
            first = {"model": MODEL, "prompt": scored["prompt"][:-9], "max_tokens": 4, "temperature": 0}
            answers[cached].append(httpx.post(f"{server.url}/v1/completions", json=first, timeout=120).json()
                                   ["choices"][0]["text"])  # cached: the scored prompt starts with it
            answers[cached].append(httpx.post(f"{server.url}/v1/completions", json=scored, timeout=120).json()
                                   ["choices"][0]["logprobs"]["token_logprobs"])
            prompt = server.metric("prescient_prompt_tokens_total")
            reused = server.metric("prescient_prompt_tokens_cached_total")
            prefill_misses = server.metric("prescient_prefill_expert_cache_misses_total")
            assert 0 < prefill_misses < server.metric("prescient_expert_cache_misses_total")
            if cached:
                assert 0 < server.metric("prescient_prefix_cache_bytes") <= cached
                assert server.metric("prescient_prefix_cache_entries") >= len(chats)
                assert reused > prompt / 3  # later turns resend the earlier ones
            else:
                assert reused == 0
    assert answers[2**20][:-1] == answers[0][:-1]
    torch.testing.assert_close(torch.tensor(answers[2**20][-1][1:]), torch.tensor(answers[0][-1][1:]))


def test_a_memory_cap_reserves_room_for_the_prefix_cache(tiny_moe_dir):
    directory, options = ModelDirectory.open(tiny_moe_dir("mixtral")), RuntimeOptions(memory=2**30)
    reserved = MemoryPlanner(directory, options, Reserves(prefix_cache=2**26)).reserve(0)
    assert reserved == MemoryPlanner(directory, options).reserve(0) + 2**26  # the cap stays the user's
