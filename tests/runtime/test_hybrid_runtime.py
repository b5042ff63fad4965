"""HybriMoE's scheduler in the runtime (`RuntimeOptions.hybrid_schedule`, `offload_runtime.engine.hybrid`):
experts computed where they live give the outputs a slot gives, bit for bit, in float32 and
bfloat16, at slot counts below, at and above a layer's routed experts:

- CPU-only host: admission (a miss predicted to be reused later than every resident expert is
  computed from a scratch buffer, nothing evicted), from the disk store's scratch slots and from
  the host store's own tensors;
- GPU host's split (the CPU beside the device, on a thread of its own), with the "device" the CPU
  too, so CI runs its logic: the scheduler's measured costs replaced by ones that send the
  low-load misses to the CPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as tf

from cache import ExpertCache, make_serving_policy
from offload_runtime.engine.hybrid import HybridExperts, admitted, measure_times, split_layer
from offload_runtime.engine.hybrid_schedule import DeviceTimes
from offload_runtime.engine.loader import load_offloaded
from offload_runtime.engine.options import OptionsError, RuntimeOptions
from prescient.arch_zoo import save_tiny_model
from prescient.loading import load_model, load_tokenizer
from tests.conftest import random_sida
from training.reference_recipe import recipe

PROMPT = "def read_config(path):\n    with open(path) as f:\n        return json.load(f)  # the settings"
NEW_TOKENS = 6
CHEAP_CPU = DeviceTimes(fast_compute_s=1.0, slow_s_per_token=0.4, transfer_s=3.0)  # a load-1 miss: the CPU


@pytest.fixture(scope="module")
def reference(tiny_tokenizer, tmp_path_factory):
    """A random model of the reference recipe's shape (Mixtral, 4 layers, 16 experts, top-2) and an
    untrained SiDA hash function with forecast heads (learned eviction reads its chances)."""
    root = tmp_path_factory.mktemp("hybrid")
    config = tf.MixtralConfig(vocab_size=len(tiny_tokenizer), pad_token_id=tiny_tokenizer.pad_token_id,
                              eos_token_id=tiny_tokenizer.eos_token_id, **recipe("tiny")["model"])
    path = save_tiny_model(config, root / "model", seed=3, tokenizer=tiny_tokenizer)
    return path, random_sida(path, root, horizon=2)


def plain_outputs(path, dtype: str, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    model, _ = load_model(path, dtype=getattr(torch, dtype))
    for param in model.parameters():  # weights in memory of their own (see test_exact_offloading)
        param.data = param.data.clone()
    return outputs(model, ids)


def outputs(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The prompt's logits, the greedy tokens and every decode step's logits."""
    with torch.inference_mode():
        prefill = model(ids).logits
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=model.config.pad_token_id)
    return prefill, out.sequences, torch.stack(out.logits)


def offloaded_outputs(path, predictor, split: bool = False, **options):
    model = load_offloaded(path, predictor, RuntimeOptions(hybrid_schedule=True, policy="learned-belady", prediction_guard=False, **options))
    runtime = model.runtime
    if split:  # the GPU host's schedule, the "device" being the CPU too
        runtime.hybrid.close()
        runtime.hybrid = HybridExperts(runtime.store, runtime.pool, runtime.n_experts, runtime.top_k, split=True)
        runtime.hybrid.times = CHEAP_CPU
    with runtime:
        got = outputs(model, load_tokenizer(path)(PROMPT, return_tensors="pt").input_ids)
        return got, runtime.stats()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("store, split", [("disk", False), ("host", False), ("host", True)])
def test_experts_computed_where_they_live_are_exact(reference, dtype, store, split):
    path, predictor = reference
    ids = load_tokenizer(path)(PROMPT, return_tensors="pt").input_ids
    want = plain_outputs(path, dtype, ids)
    computed = 0
    # a layer routes the prompt to all 16 experts: below it (one token's top-k, and 6), at it, above it
    for slots in (2, 6, 16, 24):
        got, stats = offloaded_outputs(path, predictor, split, budget=f"{slots}slots", dtype=dtype, store=store)
        for name, a, b in zip(("prefill logits", "tokens", "decode logits"), got, want):
            assert torch.equal(a, b), (slots, name)
        assert stats.accesses == stats.hits + stats.misses
        computed += stats.where_it_lives
    assert computed > 0  # the schedule did compute experts where they live


def test_admission_bypasses_only_misses_predicted_later_than_every_resident():
    policy = make_serving_policy("learned-belady", top_k=2)
    cache = ExpertCache(3, policy, n_layers=2, top_k=2, n_experts=4)
    cache.prefetch_many([(1, 0), (1, 1), (1, 2)])
    chances = np.zeros((2, 4))
    chances[1, :3] = [0.5, 0.3, 0.9]
    cache.on_forecast(chances)
    later = np.zeros((2, 4))
    later[0] = [0.1, 0.29, 0.31, 0.0]
    # layer 0's experts 0-2 all miss; resident layer 1's lowest chance is 0.3: 0.1 and 0.29 are below it
    assert admitted(0, [0, 1, 2], [False] * 3, cache, later) == [0, 1]
    assert admitted(0, [0, 1], [False] * 2, cache, None) == []  # no table yet: no forecast
    assert admitted(1, [1, 0], [True, True], cache, later) == []  # hits are never bypassed
    cache.pin((1, 1))
    assert admitted(0, [0, 1, 2], [False] * 3, cache, later) == [0, 1, 2]  # a pinned key is no floor: 0.5 is
    lru = ExpertCache(3, make_serving_policy("lru", top_k=2), n_layers=2, top_k=2, n_experts=4)
    lru.prefetch_many([(1, 0)])
    assert admitted(0, [0], [False], lru, later) == []  # no forecasts: no admission


def test_the_split_follows_hybrimoe_cached_high_load_on_the_device_low_load_misses_on_the_cpu():
    # expert 5 cached; 1 (9 tokens) is worth the copy; 2 and 3 (one token each) compute on the CPU
    assert sorted(split_layer([5, 1, 2, 3], [4, 9, 1, 1], [True, False, False, False], CHEAP_CPU)) == [2, 3]


def test_measured_times_are_positive(reference):
    path, _ = reference
    model = load_offloaded(path, None, RuntimeOptions(hybrid_schedule=True, store="host", budget="4slots"))
    with model.runtime as runtime:
        experts = model.model.layers[0].mlp.experts
        host = {name: t[0] for name, t in runtime.hybrid.buffers(0)[0].items()}
        times = measure_times(experts._twin, experts._lives, host, model.config.hidden_size, torch.float32,
                              torch.device("cpu"))
    assert times.fast_compute_s > 0 and times.slow_s_per_token > 0 and times.transfer_s > 0


def test_the_hybrid_schedule_refuses_packed_slots():
    with pytest.raises(OptionsError, match="expanded"):
        RuntimeOptions(hybrid_schedule=True, slot_format="packed", dtype="bfloat16")
    assert RuntimeOptions(hybrid_schedule=True).to_json()["hybrid_schedule"] is True


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_cpu_beside_the_gpu_gives_the_gpus_outputs(reference):
    """On a GPU host (store host) the measured schedule splits the misses; the CPU side's outputs
    agree with the plain model's on the GPU up to the devices' float32 rounding."""
    path, predictor = reference
    ids = load_tokenizer(path)(PROMPT, return_tensors="pt").input_ids.cuda()
    plain, _ = load_model(path, dtype=torch.float32)
    want = outputs(plain.cuda(), ids)
    model = load_offloaded(path, predictor, RuntimeOptions(hybrid_schedule=True, store="host", device="cuda",
                                                           budget="6slots", policy="learned-belady"))
    with model.runtime as runtime:
        runtime.hybrid.times = CHEAP_CPU  # some misses on the CPU whatever this GPU measures
        got = outputs(model, ids)
        assert runtime.stats().where_it_lives > 0
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    assert torch.equal(got[1], want[1])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_copies_from_many_workers_into_one_slot_end_with_the_last(reference):
    """Real streams: 8 workers copy experts into slot 0 one request after another, no wait between
    (each newer one supersedes a queued one, or follows a running one on another stream); the slot
    ends holding the last, whole (two copies overlapping on the device would mix them)."""
    from offload_runtime.engine.slots import SlotPool
    from offload_runtime.engine.store import ExpertStore
    from offload_runtime.engine.transfer import TransferEngine

    path, _ = reference
    model, layers = load_model(path, dtype=torch.float32)
    with ExpertStore(path, model, layers, mode="host") as store:
        pool = SlotPool.for_budget(store.specs, store.num_experts, 2, budget="2slots", device="cuda")
        with TransferEngine(store, pool, workers=8) as engine:
            for round_ in range(16):
                keys = [(i % len(layers), (i * 7 + round_) % store.num_experts) for i in range(16)]
                for key in keys:
                    engine.request(key, 0, demand=True)
                engine.wait(keys[-1])
                for name, tensor in store.resident(keys[-1]).items():
                    assert torch.equal(pool.view(0)[name].cpu(), tensor), (round_, name)
