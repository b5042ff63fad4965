"""Learned eviction in the serving runtime: the hash-building thread's tables carry the forecast
heads' chances of use, the cache ranks by them, and generation stays exact; hide-only prefetch
(a link timing) issues only the copies that can end before their layer runs; cross-token
prefetch reaches into the next forward with the forecast of its token."""

import dataclasses

import numpy as np
import pytest
import torch

from cache.history import FORECAST_WEIGHT
from cache.timing import LinkTiming
from offload_runtime.engine.hash_builder import HashTable
from offload_runtime.engine.loader import load_offloaded
from predictor import ForecastHorizonError, PredictorError, PredictorMeta, SiDAHash, SiDAPredictor, SiDASizes
from predictor.forecast import DISCOUNT
from prescient.fingerprint import fingerprint_model
from prescient.loading import load_model
from tests.runtime.test_offloaded_generate import encode, generate, save_tiny_predictor, wait_for_tables

SIZES = SiDASizes(compress_dim=8, hidden_dim=12, attn_window=4)


def forecasting_sida(path, horizon: int = 2) -> SiDAPredictor:
    model, layers = load_model(path, dtype=torch.float32)
    fingerprint = fingerprint_model(model, layers)
    torch.manual_seed(0)
    hash_fn = SiDAHash.from_embedding(model.get_input_embeddings().weight.detach(), fingerprint.n_moe_layers,
                                      fingerprint.n_experts, SIZES, horizon)
    return SiDAPredictor(hash_fn, PredictorMeta("sida", fingerprint, {**dataclasses.asdict(SIZES), "horizon": horizon}))


def record_forecasts(runtime) -> list[tuple[int | None, np.ndarray]]:
    """Every (layer, chances) the runtime hands its cache's `on_forecast` from now on, in order
    (layer None: a forward's whole table; a call for several layers: one entry per layer), still
    passed on to the cache."""
    fed = []
    on_forecast = runtime.cache.on_forecast

    def record(chances, layer=None):
        fed.extend((one, np.array(chances)) for one in ([None] if layer is None else np.atleast_1d(layer).tolist()))
        on_forecast(chances, layer=layer)

    runtime.cache.on_forecast = record
    return fed


@pytest.mark.parametrize("policy", ["learned", "learned-belady"])
def test_learned_eviction_is_exact_and_ranks_by_the_forecasts(tiny_moe_dir, policy):
    path = tiny_moe_dir("mixtral")
    inputs = encode(path, encoder_decoder=False)
    plain, _ = load_model(path, dtype=torch.float32)
    want = generate(plain, inputs, new_tokens=6)
    model = load_offloaded(path, prediction_guard=False, predictor=forecasting_sida(path), policy=policy, budget=0.5)
    wait_for_tables(model)
    runtime = model.runtime
    recorded = record_forecasts(runtime)
    with runtime:
        out = generate(model, inputs, new_tokens=6)
        # a layer's renewed chances reach the cache once they can decide something: the last
        # forward's wait for a next one (which sends them first)
        assert runtime.prefetcher.unsent[-1] == len(runtime.layers) - 1
        runtime.prefetcher.send_forecasts()
    assert torch.equal(out, want)
    fed = [(layer, chances) for layer, chances in recorded if layer is None]
    after_layer = [(layer, chances) for layer, chances in recorded if layer is not None]
    assert len(fed) == runtime.stats().tables_on_time == 6  # one forecast per forward, from its table
    assert all(f.shape == (len(runtime.layers), runtime.n_experts) and 0 <= f.min() and f.max() <= 1 for _, f in fed)
    # then, as each layer runs, its experts take their chances of use by later forwards: never above those
    # counted from this forward, which add this forward's own chance
    assert [layer for layer, _ in after_layer] == list(range(len(runtime.layers))) * 6
    assert all((later <= fed[i // len(runtime.layers)][1] + 1e-6).all() for i, (_, later) in enumerate(after_layer))
    assert any((later < fed[i // len(runtime.layers)][1] - 1e-3).any() for i, (_, later) in enumerate(after_layer))
    assert runtime.cache.state.outside.max() > 0  # the forecasts reached the ranks


def test_a_late_table_gives_the_layers_already_run_their_later_chances(tiny_moe_dir):
    path = tiny_moe_dir("mixtral")
    model = load_offloaded(path, prediction_guard=False, predictor=forecasting_sida(path), policy="learned-belady", budget=0.5)
    with model.runtime as runtime:
        n_layers, n_experts = len(runtime.layers), runtime.n_experts
        soon, later = torch.full((n_layers, n_experts), 0.8), torch.full((n_layers, n_experts), 0.2)
        runtime.builder.poll = lambda step: HashTable(step, torch.zeros(n_layers, n_experts), 1, soon, later)
        runtime.prefetcher.history.average[:] = 0.0  # no use yet: the chances count FORECAST_WEIGHT of theirs
        fed = record_forecasts(runtime)
        last = n_layers - 1
        runtime._prefetch_after(last)  # the forward's table comes while its last layer runs
        runtime.prefetcher.send_forecasts()
        (whole_layer, whole), (run_layer, run) = fed
        assert whole_layer is None and np.allclose(whole[:last], 0.2 * FORECAST_WEIGHT)
        assert np.allclose(whole[last:], 0.8 * FORECAST_WEIGHT)
        assert run_layer == last and np.allclose(run[last], 0.2 * FORECAST_WEIGHT)


def test_the_tables_chances_are_the_predictors_own(tiny_moe_dir):
    """A predictor says how its scores become chances of being picked (the oracle's are certain)."""
    path = tiny_moe_dir("mixtral")
    predictor = forecasting_sida(path)
    predictor.chance_selected = lambda scores, top_k: torch.ones_like(scores)  # certain of every expert
    model = load_offloaded(path, prediction_guard=False, predictor=predictor, policy="learned-belady", budget=0.5)
    wait_for_tables(model)
    runtime = model.runtime
    runtime.prefetcher.history.blend = lambda chances, layer=None: chances  # the predictor's chances alone
    fed = record_forecasts(runtime)
    with runtime:
        generate(model, encode(path, encoder_decoder=False), new_tokens=3)
    soon = [chances for layer, chances in fed if layer is None]
    later = [chances for layer, chances in fed if layer is not None]
    assert soon and all(np.allclose(chances, 1.0) for chances in soon)
    weights = DISCOUNT ** np.arange(predictor.horizon + 1)
    assert later and all(np.allclose(chances, weights[1:].sum() / weights.sum()) for chances in later)


def test_learned_eviction_needs_a_predictor_with_forecast_heads(tiny_moe_dir, tmp_path):
    path = tiny_moe_dir("mixtral")
    with pytest.raises(PredictorError, match="--model.horizon"):
        load_offloaded(path, policy="learned", budget=0.5)
    with pytest.raises(ForecastHorizonError, match="--model.horizon"):
        load_offloaded(path, prediction_guard=False, predictor=save_tiny_predictor("frequency", path, tmp_path), policy="learned", budget=0.5)


@pytest.mark.parametrize(("compute_s", "transfer_s", "prefetches"), [(1e-3, 1.0, False), (1.0, 1e-3, True)])
def test_hide_only_prefetch_issues_only_what_the_link_can_hide(tiny_moe_dir, compute_s, transfer_s, prefetches):
    path = tiny_moe_dir("mixtral")
    inputs = encode(path, encoder_decoder=False)
    plain, _ = load_model(path, dtype=torch.float32)
    want = generate(plain, inputs, new_tokens=6)
    link = LinkTiming(compute_s, 100.0, 100.0 / transfer_s)  # a copy takes transfer_s, a layer computes compute_s
    model = load_offloaded(path, prediction_guard=False, predictor=forecasting_sida(path), policy="lru", budget=0.5, link_timing=link)
    wait_for_tables(model)
    with model.runtime as runtime:
        out = generate(model, inputs, new_tokens=6)
        stats = runtime.stats()
    assert torch.equal(out, want)
    assert stats.tables_on_time > 0 and (stats.prefetch_inserts > 0) == prefetches


def test_cross_token_prefetch_loads_the_next_forwards_layers_and_stays_exact(tiny_moe_dir):
    path = tiny_moe_dir("mixtral")
    inputs = encode(path, encoder_decoder=False)
    plain, _ = load_model(path, dtype=torch.float32)
    want = generate(plain, inputs, new_tokens=6)
    model = load_offloaded(path, prediction_guard=False, predictor=forecasting_sida(path), policy="lru", budget=0.5, next_token_min_chance=0.0)
    wait_for_tables(model)
    runtime = model.runtime
    layer_now, early = [-1], []  # prefetched keys of a layer not after the one running: the next forward's
    prefetch_after, prefetch = runtime._prefetch_after, runtime.prefetch

    def spy_layer(layer, *args):
        layer_now[0] = layer
        prefetch_after(layer, *args)

    def spy_prefetch(keys, priority=0.0):
        early.extend(key for key in keys if key[0] <= layer_now[0])
        return prefetch(keys, priority)

    runtime._prefetch_after, runtime.prefetch = spy_layer, spy_prefetch
    with runtime:
        out = generate(model, inputs, new_tokens=6)
    assert torch.equal(out, want)
    assert early, "no prefetch reached into the next forward"
    assert all(len(keys) <= runtime.prefetcher.per_layer for keys in runtime.prefetcher.wanted_next)


def test_cross_token_prefetch_keeps_only_likely_experts(tiny_moe_dir):
    path = tiny_moe_dir("mixtral")
    model = load_offloaded(path, prediction_guard=False, predictor=forecasting_sida(path), policy="lru", budget=0.5, next_token_min_chance=0.5)
    with model.runtime as runtime:
        chances = torch.zeros(len(runtime.layers), runtime.n_experts)
        chances[0, 3], chances[1, 1], chances[1, 2] = 0.9, 0.5, 0.49
        assert runtime.prefetcher._next_keys(chances)[:2] == [[(0, 3)], [(1, 1)]]


def test_cross_token_prefetch_on_the_cpu_under_learned_eviction_asks_nothing_in_token(tiny_moe_dir):
    """Learned eviction on the CPU prefetches nothing for the running token (a wrong guess read from
    disk displaces a kept expert), but cross-token prefetch still asks for the next token's likely
    experts, the model's top-k per layer at most."""
    path = tiny_moe_dir("mixtral")
    model = load_offloaded(path, prediction_guard=False, predictor=forecasting_sida(path), policy="learned-belady",
                           budget=0.5, next_token_min_chance=0.5)
    with model.runtime as runtime:
        assert runtime.prefetcher.per_layer == 0
        chances = torch.full((len(runtime.layers), runtime.n_experts), 0.6)
        assert [len(keys) for keys in runtime.prefetcher._next_keys(chances)] == [runtime.top_k] * len(runtime.layers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_token_prefetch_under_learned_eviction_stays_exact(tiny_moe_dir, dtype):
    """Every forecast prefetched (least chance 0) beside learned eviction, at 2 slots (below one
    layer's routed experts: the layer's pins leave no room to prefetch), half of them (prefetches
    land) and all: the plain model's greedy tokens in both dtypes."""
    path = tiny_moe_dir("mixtral")
    inputs = encode(path, encoder_decoder=False)
    plain, _ = load_model(path, dtype=dtype)
    want = generate(plain, inputs, new_tokens=6)
    for budget in ("2slots", 0.5, 1.0):
        model = load_offloaded(path, prediction_guard=False, predictor=forecasting_sida(path), policy="learned-belady",
                               budget=budget, dtype=str(dtype).removeprefix("torch."), next_token_min_chance=0.0)
        with model.runtime as runtime:
            assert torch.equal(generate(model, inputs, new_tokens=6), want), budget
            assert runtime.prefetcher.per_layer == 0 and (budget != 0.5 or runtime.stats().prefetch_inserts > 0)


def test_cross_token_prefetch_bad_input(tiny_moe_dir, tmp_path):
    path = tiny_moe_dir("mixtral")
    with pytest.raises(PredictorError, match="cross-token prefetch needs a predictor's forecasts"):
        load_offloaded(path, policy="lru", budget=0.5, next_token_min_chance=0.5)
    with pytest.raises(ForecastHorizonError, match="--model.horizon"):
        load_offloaded(path, prediction_guard=False, predictor=save_tiny_predictor("frequency", path, tmp_path), policy="lru", budget=0.5,
                       next_token_min_chance=0.5)
    with pytest.raises(PredictorError, match=r"must be in \[0, 1\], got 1.5"):
        load_offloaded(path, prediction_guard=False, predictor=forecasting_sida(path), policy="lru", budget=0.5, next_token_min_chance=1.5)


def test_hide_only_counts_from_when_the_running_layers_own_demand_loads_are_in(tiny_moe_dir, monkeypatch):
    path = tiny_moe_dir("mixtral")
    link = LinkTiming(1.0, 100.0, 100.0 / 0.9)  # one copy (0.9 s) fits behind one layer's compute (1 s)
    model = load_offloaded(path, prediction_guard=False, predictor=forecasting_sida(path), policy="lru", budget=0.5, link_timing=link)
    with model.runtime as runtime:
        key = next((1, e) for e in range(runtime.n_experts) if (1, e) not in runtime.cache)
        monkeypatch.setattr(type(runtime.engine), "pending", property(lambda _engine: 1))  # a copy waiting
        # it is this layer's demand load: the link is free
        assert runtime.prefetcher._hideable([[key]], demand_loads=1) == [key]
        assert runtime.prefetcher._hideable([[key]], demand_loads=0) == []  # another prefetch: no room left


def test_on_the_cpu_learned_eviction_prefetches_nothing_unless_asked(tiny_moe_dir):
    """The forecasts rank the evictions; no expert is read ahead of need (by default: a prefetch
    count named is a prefetch count used)."""
    path = tiny_moe_dir("mixtral")
    inputs = encode(path, encoder_decoder=False)
    want = generate(load_model(path, dtype=torch.float32)[0], inputs, new_tokens=6)
    for named, prefetches in (({}, False), ({"prefetch_per_layer": 2}, True)):
        model = load_offloaded(path, prediction_guard=False, predictor=forecasting_sida(path),
                               policy="learned-belady", budget=0.5, **named)
        wait_for_tables(model)
        with model.runtime as runtime:
            assert torch.equal(generate(model, inputs, new_tokens=6), want)
            stats = runtime.stats()
        assert stats.tables_on_time == 6 and runtime.cache.state.outside.max() > 0  # the forecasts ranked
        assert (stats.prefetch_inserts > 0) == prefetches


def test_a_certain_predictors_forecasts_rank_alone(tiny_moe_dir):
    """The oracle's chances are the truth: no history of use is blended into them."""
    path = tiny_moe_dir("mixtral")
    predictor = forecasting_sida(path)
    predictor.certain = True
    model = load_offloaded(path, prediction_guard=False, predictor=predictor, policy="learned-belady", budget=0.5)
    with model.runtime as runtime:
        runtime.prefetcher.history.average[:] = 1.0
        chances = np.full((len(runtime.layers), runtime.n_experts), 0.25)
        assert np.array_equal(runtime.prefetcher.history.blend(chances), chances)


def test_renewed_chances_sent_late_evict_as_if_sent_at_each_layer(tiny_moe_dir, monkeypatch):
    """The prefetcher holds a layer's renewed chances until they can decide an eviction (one call
    a forward instead of one a layer): the cache evicts exactly what it evicts when each is sent
    as its layer runs."""
    from offload_runtime.engine.prefetch import Prefetcher

    path = tiny_moe_dir("mixtral")
    inputs = encode(path, encoder_decoder=False)

    def evictions() -> list:
        model = load_offloaded(path, prediction_guard=False, predictor=forecasting_sida(path),
                               policy="learned-belady", budget=0.3)
        wait_for_tables(model)
        evicted = []
        with model.runtime as runtime:
            on_evict = runtime.cache.on_evict
            runtime.cache.on_evict = lambda key: (evicted.append(key), on_evict(key))
            generate(model, inputs, new_tokens=8)
        return evicted

    late = evictions()
    keys_after = Prefetcher.keys_after

    def sent_at_once(self, layer, demand_loads=0):
        keys = keys_after(self, layer, demand_loads)
        self.send_forecasts()
        return keys

    monkeypatch.setattr(Prefetcher, "keys_after", sent_at_once)
    assert late and evictions() == late
