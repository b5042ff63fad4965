"""Mixed precision: a fine (int8 per channel, or int4) and a coarse (int4, or int2) copy of every
expert, slots of both sizes under one byte budget, and a rule that picks each loaded expert's copy.

The plumbing is exact: with every expert fine the tokens are the fine model's, with the model's
own int4 copy as the fine one they are the int4 model's; with a real fine copy the rule decides
how many expert uses compute fine, and the bytes moved count each copy's own size."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cache import CacheError, ExpertCache, make_serving_policy
from cache.tiered import TieredCache
from experiments.bench_compressed import bench_compressed
from experiments.bench_runtime.grid import BenchError
from experiments.quality import measure_quality
from offload_runtime.engine.loader import load_offloaded
from offload_runtime.engine.options import OptionsError, RuntimeOptions
from predictor.base import PredictorError
from prescient.errors import CapacityError
from prescient.fingerprint import FingerprintMismatchError
from tests.conftest import random_sida
from tests.runtime.test_packed_experts import PROMPT, run


def _bytes(path) -> tuple[int, int]:
    """The model's experts in all, and one packed slot's bytes."""
    _, _, runtime = run(path, tokens=1, budget=1.0, slot_format="packed")
    return runtime.pool.num_slots, runtime.store.expert_nbytes


@pytest.mark.parametrize("coarse_bits, fine_bits", [(4, 8), (2, 4)])  # int2 + int4: slots of one size, two link widths
def test_every_expert_fine_computes_the_fine_model(coarse_bits, fine_bits, int4_model):
    coarse, fine = int4_model("mixtral", coarse_bits), int4_model("mixtral", fine_bits)
    fine_tokens, _, _ = run(fine, budget=1.0, slot_format="packed")
    experts, fine_bytes = _bytes(fine)
    # a fine tier that holds every expert; hotness ranks every used expert above the unused ones
    budget = f"{experts * fine_bytes * 10 // 8}B"
    out, _, runtime = run(coarse, budget=budget, slot_format="packed", fine_model=str(fine), fine_share=0.8,
                          precision_rule="hotness")
    stats = runtime.stats()
    assert torch.equal(out, fine_tokens)
    assert stats.fine_accesses == stats.accesses > 0


def test_the_models_own_copy_as_the_fine_one_computes_the_model(int4_model, tmp_path):
    int4 = int4_model("mixtral")
    resident, _, _ = run(int4, budget=1.0, slot_format="packed")
    out, _, runtime = run(int4, budget="50%", slot_format="packed", fine_model=str(int4), fine_share=0.3,
                          precision_rule="router")
    stats = runtime.stats()
    assert torch.equal(out, resident)
    assert 0 < stats.fine_accesses < stats.accesses and stats.misses > 0
    assert stats.bytes_moved == stats.loads * runtime.store.stored_nbytes((0, 0))


@pytest.mark.parametrize("rule", ["forecast", "router", "hotness"])
def test_each_rule_mixes_the_copies_and_moves_each_copys_bytes(rule, int4_model, tmp_path):
    int4, int8 = int4_model("mixtral"), int4_model("mixtral", 8)
    sida = random_sida(int4.parent / "source", tmp_path, horizon=2) if rule == "forecast" else None
    options = RuntimeOptions(dtype="bfloat16", budget="50%", slot_format="packed", fine_model=str(int8),
                             fine_share=0.3, precision_rule=rule)
    model = load_offloaded(int4, sida, options=options)
    ids = torch.tensor([list(range(3, 40))])
    with model.runtime as runtime, torch.inference_mode():
        model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                       pad_token_id=model.config.pad_token_id)
        stats = runtime.stats()
        fine, coarse = (store.stored_nbytes((0, 0)) for store in (runtime.fine_store, runtime.store))
        assert [p.num_slots for p in runtime.pool.pools] == [runtime.cache.tiers[0].capacity,
                                                             runtime.cache.tiers[1].capacity]
        assert runtime.pool.nbytes <= runtime.store.total_nbytes // 2 + 1
    assert 0 < stats.fine_accesses < stats.accesses
    assert stats.loads * coarse < stats.bytes_moved < stats.loads * fine  # both copies crossed the link


def test_mixed_quality_runs_through_the_runtime_in_decode_mode(int4_model, text_corpus):
    int4, int8 = int4_model("mixtral"), int4_model("mixtral", 8)
    source = int4.parent / "source"
    dataset = f"json:{text_corpus}"
    options = RuntimeOptions(dtype="bfloat16", budget="50%", slot_format="packed", fine_model=str(int8),
                             precision_rule="router")
    mixed = measure_quality(int4, source, (dataset,), split="train", seq_len=16, windows=2, batch_size=1,
                            options=options)
    figures = mixed["datasets"][dataset]
    assert mixed["decode"] and mixed["options"]["fine_model"] == str(int8) and mixed["fingerprint_match"]
    assert figures["tokens"] == 2 * 15 and 0 < figures["fine_share"] < 1 and figures["kl_nats"] > 0
    # a model against itself in decode mode: the same numbers, token for token
    same = measure_quality(source, source, (dataset,), split="train", seq_len=16, windows=2, decode=True)
    assert same["datasets"][dataset]["kl_nats"] == 0 and same["datasets"][dataset]["top1_agreement"] == 1


def test_what_mixed_precision_refuses(int4_model, tiny_moe_dir):
    int4, int8 = int4_model("mixtral"), int4_model("mixtral", 8)
    with pytest.raises(OptionsError, match="mixed precision .* use slot_format packed"):
        RuntimeOptions(dtype="bfloat16", fine_model=str(int8))
    with pytest.raises(OptionsError, match=r"fine_share must be a share of the budget in \(0, 1\)"):
        RuntimeOptions(fine_share=1.0)
    with pytest.raises(OptionsError, match="precision_rule must be one of forecast, router, hotness"):
        RuntimeOptions(precision_rule="weight")
    packed = {"dtype": "bfloat16", "slot_format": "packed", "fine_model": str(int8)}
    with pytest.raises(PredictorError, match="the forecast precision rule needs a predictor's forecasts"):
        load_offloaded(int4, **packed, precision_rule="forecast")
    with pytest.raises(FingerprintMismatchError):
        load_offloaded(int4, **{**packed, "fine_model": str(int4_model("qwen3_moe", 8))})
    with pytest.raises(CapacityError, match="coarse slots after .* fine ones; the minimum is one layer's top-k"):
        load_offloaded(int4, **packed, precision_rule="router", fine_share=0.9, budget="20%")
    with pytest.raises(FileNotFoundError, match="is not a model directory"):
        load_offloaded(int4, **{**packed, "fine_model": str(int4.parent)})


def test_tiered_cache_places_misses_by_rule_and_spills_to_the_other_tier():
    evicted = []
    tiers = [ExpertCache(2, make_serving_policy("lru", 1), n_layers=1, on_evict=evicted.append),
             ExpertCache(2, make_serving_policy("lru", 1), n_layers=1, on_evict=evicted.append)]
    cache = TieredCache(tiers, "router", n_layers=1, n_experts=6, per_layer=1)
    cache.on_step(0, [0.1, 0.6, 0.3, 0.0, 0.0, 0.0])
    assert cache.access_many([(0, 0), (0, 1)], pin=True) == 2
    assert cache.tier_of((0, 1)) == 0 and cache.tier_of((0, 0)) == 1  # the top-weighted expert is fine
    cache.unpin_many([(0, 0), (0, 1)])
    assert cache.access_many([(0, 1)]) == 0 and cache.stats.hits == 1 and cache.fine_accesses == 2
    cache.on_step(0, [0.0, 0.0, 0.0, 0.9, 0.05, 0.05])
    cache.access_many([(0, 3), (0, 4), (0, 5)], pin=True)  # 3 fine; the coarse tier's two slots hold 4, 5
    assert [cache.tier_of((0, e)) for e in (3, 4, 5)] == [0, 1, 1] and (0, 0) in evicted
    with pytest.raises(CacheError):
        cache.pin((0, 2))
    assert cache.prefetch_many([(0, 2)]) == [(0, 2)] and cache.tier_of((0, 2)) == 0  # only the fine tier had room


@pytest.mark.slow  # 15 s: tests/runtime/test_packed_experts.py runs bench_compressed in the default suite
def test_bench_compressed_runs_each_rule_with_the_predictors_prefetching(int4_model, tmp_path):
    int4, int8 = int4_model("mixtral"), int4_model("mixtral", 8)
    sida = random_sida(int4.parent / "source", tmp_path, horizon=2)
    mixed = {"mix-forecast": ("int4", "int8", "forecast"), "mix-router": ("int4", "int8", "router")}
    result = bench_compressed({"int4": str(int4), "int8": str(int8)}, [PROMPT * 4] * 3, [0.5], 1, {},
                              tmp_path / "bench.json", options=RuntimeOptions(dtype="bfloat16"),
                              packed=("int4", "int8"), predictor=("sida", str(sida), "learned-belady"),
                              mixed=mixed, fine_share=0.5, new_tokens=8, timed_prompts=1, prompt_tokens=6,
                              isolate=False)
    rows = result["summary"]
    assert set(rows["mix-forecast"]) == {"all_resident", "sida+learned-belady@0.5"}  # the predictor's runs only
    for name in mixed:
        row = rows[name]["sida+learned-belady@0.5"]
        assert row["exact"] is None and 0 < row["fine_share"] < 1 and row["tokens_per_s"] > 0
        assert result["models"][name]["fine_model"] == str(int8)
    assert rows["int4"]["sida+learned-belady@0.5"]["exact"] and rows["int4"]["sida+learned-belady@0.5"]["fine_share"] is None
    with pytest.raises(BenchError, match="needs two --packed models"):
        bench_compressed({"int4": str(int4)}, [PROMPT], [0.5], 1, {}, tmp_path / "no.json", packed=("int4",),
                         options=RuntimeOptions(dtype="bfloat16"), mixed={"m": ("int4", "int8", "router")})


def test_the_forecast_rule_ranks_by_the_expected_weight_of_later_uses():
    tiers = [ExpertCache(2, make_serving_policy("lru", 1), n_layers=1),
             ExpertCache(4, make_serving_policy("lru", 1), n_layers=1)]
    cache = TieredCache(tiers, "forecast", n_layers=1, n_experts=4, per_layer=1)
    cache.on_step(0, [0.5, 0.3, 0.2, 0.0])
    cache.on_later(np.array([[0.1, 0.9, 0.5, 1.0]]))  # expected weights 0.05, 0.27, 0.1, 0
    assert [cache.wants_fine((0, e)) for e in range(4)] == [False, True, False, False]
    cache.on_step(0, [0.9, 0.05, 0.05, 0.0])  # a new token's router scores, the same forecast
    assert [cache.wants_fine((0, e)) for e in range(4)] == [True, False, False, False]


def test_decode_mode_computes_the_logits_of_one_forward(tiny_moe_dir):
    from experiments.quality import decoded_logits
    from prescient.loading import load_model

    model, _ = load_model(tiny_moe_dir("mixtral"))
    batch = torch.randint(3, 60, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(decoded_logits(model, batch), model(batch).logits, atol=1e-4, rtol=1e-4)
