"""The prediction guard: with forecasts that are wrong, the runtime stops acting on them and loads
no more experts than LRU would (but for the window that judged them: later probes run in the
shadow); with forecasts that are
right, it keeps their gain where loads are slow, and sleeps the predictor where they are so fast
that predicting costs more than it saves; either way it computes the plain model's tokens."""

from __future__ import annotations

import time
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig

from cache import ExpertCache, make_policy
from offload_runtime.engine import prediction_guard
from offload_runtime.engine.loader import load_offloaded
from prescient.loading import load_model
from prescient.model_dir import load_tokenizer
from tests.runtime.test_learned_eviction_runtime import forecasting_sida

NEW_TOKENS = 96
PROMPT = "def read_config(path):\n    with open(path) as f:"


def _run(path, inputs, predictor=None, read_seconds=0.0, **options):
    """(generated ids, runtime statistics, keys accessed in order) of one greedy generation; each
    expert read takes `read_seconds` more (a tiny model's experts load in microseconds, a real
    model's in milliseconds)."""
    model = load_offloaded(path, predictor, budget=0.25, **options)
    store = model.runtime.store
    read = store.read

    def slow_read(*args, **kwargs):
        time.sleep(read_seconds)
        return read(*args, **kwargs)

    store.read = slow_read
    accessed = Counter()
    access_many = model.runtime.cache.access_many

    def counting(keys, pin=False):
        accessed.update(keys)
        return access_many(keys, pin=pin)

    model.runtime.cache.access_many = counting
    with model.runtime as runtime, torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        runtime.builder and runtime.builder.wait(runtime.step, 5.0)
        return out, runtime.stats(), accessed


def _steering(predictor, favoured: torch.Tensor):
    """`predictor` made to predict, for every token and every forecast, the experts in `favoured`
    ([L, E] of 0/1) with certainty."""
    logits = favoured.float() * 20 - 10  # sigmoid/softmax: near 1 where favoured, near 0 elsewhere
    step, forecast = predictor.step, predictor.forecast
    predictor.step = lambda state, ids: step(state, ids) * 0 + logits
    predictor.forecast = lambda state, horizon=None: forecast(state, horizon) * 0 + logits
    return predictor


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def case(tiny_moe_dir, request):
    path, dtype = tiny_moe_dir("mixtral"), request.param
    inputs = dict(load_tokenizer(path)(PROMPT, return_tensors="pt"))
    with torch.inference_mode():
        want = load_model(path, dtype=getattr(torch, dtype))[0].generate(
            **inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    _, lru, accessed = _run(path, inputs, policy="lru", dtype=dtype)
    return path, inputs, want, lru, accessed, dtype


def _least_used(accessed: Counter, n_layers: int, n_experts: int, count: int) -> torch.Tensor:
    favoured = torch.zeros(n_layers, n_experts)
    for layer in range(n_layers):
        for expert in sorted(range(n_experts), key=lambda e: accessed[(layer, e)])[:count]:
            favoured[layer, expert] = 1
    return favoured


def test_wrong_forecasts_are_dropped_and_the_run_loads_no_more_than_lru(case):
    path, inputs, want, lru, accessed, dtype = case
    n_layers, n_experts = len({key[0] for key in accessed}), 1 + max(key[1] for key in accessed)
    wrong = _least_used(accessed, n_layers, n_experts, 2)
    runs = {}
    for guarded in (False, True):
        predictor = _steering(forecasting_sida(path), wrong)
        out, stats, _ = _run(path, inputs, predictor, policy="learned-belady", prediction_guard=guarded,
                                dtype=dtype)
        assert torch.equal(out, want)
        runs[guarded] = stats
    assert runs[False].loads > 1.2 * lru.loads  # acting on the wrong forecasts loses
    # paused once judged, for a whole sleep at least, then probed in the shadow (a probe's 8 forwards
    # may win once by chance, its window then lost again)
    guarded = runs[True]
    assert guarded.prediction_lost_windows in (1, 2) and guarded.prediction_probe_forwards >= prediction_guard.SHADOW_WINDOW
    assert guarded.prediction_paused_forwards >= _shortest_sleep(path, n_layers)
    # each forward took its table (acting or probing; on time or late) or ran with the predictor asleep
    assert guarded.late_tables + guarded.tables_on_time + guarded.prediction_paused_forwards == guarded.forwards
    # what it lost is what the moving sum needed to judge the forecasts: a few hits, not the unguarded
    # run's (here 0.05 against LRU's 0.22)
    assert guarded.hit_rate >= lru.hit_rate - 0.03 > runs[False].hit_rate + 0.1
    assert guarded.loads <= lru.loads + 4 * prediction_guard.WINDOW


def _shortest_sleep(path, n_layers: int) -> int:
    """Forwards the first sleep lasts at least: until the live cache misses `PROBE_AFTER` experts, a
    forward missing at most every expert it routes to."""
    return prediction_guard.PROBE_AFTER // (n_layers * AutoConfig.from_pretrained(path).num_experts_per_tok)


def _most_used(path, accessed: Counter) -> torch.Tensor:
    n_layers, n_experts = len({key[0] for key in accessed}), 1 + max(key[1] for key in accessed)
    return _least_used(Counter({k: -v for k, v in accessed.items()}), n_layers, n_experts, 2)


class _Live:
    """The live cache as the guard sees it: counts the test sets, forecasts it counts."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.stats, self.forecasts = capacity, SimpleNamespace(misses=0, prefetch_inserts=0), 0
        self.recent: list = []  # the keys the test accessed that LRU holds, least recent first

    def on_forecast(self, chances, layer=None) -> None:
        self.forecasts += 1

    def touch(self, key) -> None:
        self.recent = [k for k in self.recent if k != key][-(self.capacity - 1):] + [key]

    def eviction_order(self) -> list:
        return list(self.recent)


def _judge(forwards: int, saved_per_forward: int, seconds_per_miss: float, predictor_seconds: float,
           prompt_prefetches: int = 0, compute_seconds: float = 0.0, saved_live: float | None = None,
           wake_seconds: float = 0.0, slow_spell: tuple[range, float] = (range(0), 1.0)):
    """A guard over `forwards` forwards of one access each, cycling over one expert more than the 4
    slots hold (LRU misses every one); its predictions prefetch `saved_per_forward` (0 or 1) of those
    in time: into the probe's twin while it probes, and (`saved_live`, by default the same; a share:
    0.5 every other forward) into the live cache while it acts, which misses the rest; a copy takes
    `seconds_per_miss` (times the factor in the forwards of `slow_spell`), all of it waited for on a
    miss, and predicting takes `predictor_seconds` a forward while awake; the first forward that acts
    also prefetches `prompt_prefetches` experts (a table's burst), and the first after each wake-up
    predicts `wake_seconds` more (the catch-up over the tokens kept asleep). Returns the guard and its
    sleep/wake calls in order. A forward's time is its waits, its prediction and `compute_seconds`."""
    live, calls = _Live(4), []
    spent = {"stall": 0.0, "demand": 0, "predicting": 0.0, "copying": 0.0, "loads": 0}
    forward, clock, burst = 0, [0.0], prompt_prefetches
    saved_live = saved_per_forward if saved_live is None else saved_live
    guard = prediction_guard.PredictionGuard(live, 1, 8, 1, lambda: prediction_guard.Spent(*spent.values()),
                                             lambda asleep: calls.append((forward, asleep)),
                                             # a twin that evicts for what it is handed (a learned policy
                                             # would want forecasts): the prefetches save its misses
                                             lambda: make_policy("lru"), clock=lambda: clock[0])
    for forward in range(forwards):
        guard.on_forward()
        key = (0, forward % 5)
        if guard.shadowing and saved_per_forward:
            guard.prefetch([key])
        guard.access([key])
        live.touch(key)
        prefetched = int((forward + 1) * saved_live) - int(forward * saved_live) if guard.acting else 0
        wait = seconds_per_miss * (slow_spell[1] if forward in slow_spell[0] else 1.0)
        if guard.acting and burst:
            live.stats.prefetch_inserts += burst
            spent["loads"] += burst
            burst = 0
        live.stats.misses += 1 - prefetched
        live.stats.prefetch_inserts += prefetched
        spent["demand"] += 1 - prefetched
        spent["stall"] += (1 - prefetched) * wait
        spent["loads"] += 1
        spent["copying"] += wait
        predicting = predictor_seconds if guard.acting or guard.shadowing else 0.0
        if calls and calls[-1] == (forward, False):
            predicting += wake_seconds
        spent["predicting"] += predicting
        clock[0] += compute_seconds + (1 - prefetched) * wait + predicting
    return guard, calls


def test_a_predictor_that_saves_more_time_than_it_costs_keeps_acting():
    # every miss hidden by a prefetch, at 3 ms a copy, for 1 ms of prediction a forward
    guard, calls = _judge(96, 1, 0.003, 0.001)
    assert guard.acting and guard.lost_windows == 0 and calls == [] and guard.probe_forwards == 0


def test_a_slow_spell_of_reads_does_not_pause_predictions_that_save_loads():
    """Predictions that save every other miss keep acting through 16 forwards, late in a run, whose loads
    wait five times as long (a disk's slow spell): the time sums count demand loads at the run's wait
    per miss. (Weighing the window's measured waits against LRU's misses at the run's wait paused
    them at the spell's 10th forward.)"""
    spell = (range(200, 216), 5.0)
    guard, calls = _judge(240, 1, 0.003, 0.0002, saved_live=0.5, slow_spell=spell)
    assert guard.acting and guard.lost_windows == 0 and calls == []
    # predictions that save nothing, at a cost, are still paused, long before the spell
    guard, calls = _judge(240, 1, 0.003, 0.003, saved_live=0.0, slow_spell=spell)
    assert guard.lost_windows >= 1 and calls[0][1] is True and calls[0][0] < 2 * prediction_guard.WINDOW


def test_the_prompts_prefetches_are_not_held_against_the_decode():
    """A prompt's table prefetches dozens of experts at once; judged from the warm-up on, a predictor
    that saves time while decoding keeps acting."""
    guard, calls = _judge(96, 1, 0.003, 0.001, prompt_prefetches=20)
    assert guard.acting and guard.lost_windows == 0 and calls == []


def test_a_predictor_that_costs_more_than_it_saves_sleeps_and_is_probed_in_the_shadow_less_often():
    # the same misses hidden at 0.1 ms a copy, for 1 ms of prediction: paused once acting, then each
    # probe in the shadow shows the twin's saved misses worth less than the predicting
    forwards = 7 * prediction_guard.PROBE_AFTER
    guard, calls = _judge(forwards, 1, 0.0001, 0.001)
    assert [asleep for _, asleep in calls][:5] == [True, False, True, False, True]  # paused, probed, asleep...
    (paused, _), (probed, _), (again, _), (probed_again, _), _ = calls[:5]
    assert paused <= prediction_guard.WARMUP + 4 and again - probed == prediction_guard.SHADOW_WINDOW + 1
    assert probed - paused == prediction_guard.PROBE_AFTER  # slept (a miss a forward), then probed
    assert probed_again - again == 2 * (probed - paused)  # a probe that lost: twice as long a sleep
    assert guard.lost_windows == 1 and guard.lost_probes >= 2  # acted on the live cache once only
    assert guard.paused_forwards > 0.8 * forwards


def test_a_small_steady_cost_that_saves_nothing_sleeps():
    """Predictions that save no load at a third of a millisecond a forward (4% of its 8 ms): the two short
    sums stay under their slack (they saturate at a window's cost); the long one pauses them, and probes
    in the shadow find nothing saved."""
    guard, calls = _judge(160, 0, 0.003, 0.0003, compute_seconds=0.005)
    assert calls and calls[0][1] is True and calls[0][0] <= prediction_guard.WARMUP + 2 * prediction_guard.COST_WINDOW
    assert guard.lost_windows == 1 and not guard.acting
    # where the same cost is a small share of slow forwards, it is noise: predictions keep acting
    guard, calls = _judge(96, 0, 0.003, 0.0003, compute_seconds=0.05)
    assert guard.acting and calls == []


def test_a_probe_is_not_charged_for_waking_the_predictor():
    """A probe's first forward steps the predictor over the tokens kept asleep (here 30 ms): spent
    whatever the probe finds, so a twin that saves a 3 ms miss a forward for 1 ms of predicting wins
    its probe (and the runtime acts again, here to lose again: the live cache saves nothing)."""
    guard, calls = _judge(96, 1, 0.003, 0.001, saved_live=0, wake_seconds=0.03)
    assert [asleep for _, asleep in calls][:3] == [True, False, True]  # paused, probed, paused again
    assert guard.lost_probes == 0 and guard.lost_windows == 2


def test_a_probe_that_has_won_acts_at_once():
    """A probe's twin that has saved `SHADOW_GAIN` misses worth more than its predicting acts from the
    next forward, not at its window's end: each forward more of the probe runs LRU where prediction
    pays. (The live cache saves nothing here, so acting is paused again, and probed again.)"""
    guard, calls = _judge(160, 1, 0.003, 0.001, saved_live=0)
    probes = sum(not asleep for _, asleep in calls)
    assert probes >= 2 and guard.lost_probes == 0 and guard.lost_windows == probes + (not guard.acting)
    # each probe: the forward that wakes the predictor, then one judged forward a miss saved
    assert guard.probe_forwards == probes * (1 + prediction_guard.SHADOW_GAIN) < probes * prediction_guard.SHADOW_WINDOW


def test_asleep_the_predictor_wakes_once_the_cache_misses_again():
    """A sleep lasts `PROBE_AFTER` misses of the live cache, not a number of forwards: where LRU misses
    nothing (a loop the slots hold whole) there is nothing to probe for; once the misses come back,
    the probe follows them."""
    live, calls = _Live(4), []
    spent = prediction_guard.Spent(0.0, 0, 0.0, 0.0, 0)
    guard = prediction_guard.PredictionGuard(live, 1, 8, 1, lambda: spent, calls.append, lambda: make_policy("lru"))
    guard._pause()
    for _ in range(10 * prediction_guard.PROBE_AFTER):
        guard.on_forward()
    assert calls == [True] and not guard.shadowing
    for forward in range(prediction_guard.PROBE_AFTER // 4):
        live.stats.misses += 4
        guard.on_forward()
        assert guard.shadowing == (forward == prediction_guard.PROBE_AFTER // 4 - 1)
    assert calls == [True, False]


def test_a_new_sequence_is_judged_afresh():
    """Whatever the last sequence made of the predictor, a new one acts on it from its first forward:
    woken, its sleeps back to the first length, the LRU shadow a copy of the live cache."""
    live = ExpertCache(3, make_policy("learned"), n_layers=1, top_k=1, n_experts=8)
    calls = []
    guard = prediction_guard.PredictionGuard(live, 1, 8, 1, lambda: prediction_guard.Spent(0.0, 0, 0.0, 0.0, 0),
                                             calls.append, lambda: make_policy("learned"))
    guard._pause()
    guard._start_probe()
    guard._lose_probe()  # a lost probe: asleep, the next sleep twice as long
    for expert in (0, 1, 2):
        live.access((0, expert))
    guard.start_sequence()
    assert guard.acting and not guard.shadowing and calls == [True, False, True, False]
    assert guard.lru.eviction_order() == live.eviction_order() == [(0, 0), (0, 1), (0, 2)]
    guard._pause()
    assert guard._sleep_length == prediction_guard.PROBE_AFTER


@pytest.mark.parametrize("budget", ["2slots", "3slots", 0.25])  # at and above a layer's top-k (fewer are refused)
def test_each_generation_acts_on_the_predictor_afresh(case, budget):
    """Through `generate`: wrong forecasts are paused in each of two generations of the same loaded
    model (the second acts again from its prompt), and both compute the plain model's tokens."""
    path, inputs, want, _, accessed, dtype = case
    n_layers, n_experts = len({key[0] for key in accessed}), 1 + max(key[1] for key in accessed)
    predictor = _steering(forecasting_sida(path), _least_used(accessed, n_layers, n_experts, 2))
    model = load_offloaded(path, predictor, budget=budget, policy="learned-belady", dtype=dtype)
    with model.runtime as runtime, torch.inference_mode():
        for generation in (1, 2):
            out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
            assert torch.equal(out, want)
            assert runtime.stats().prediction_lost_windows == generation


def test_right_forecasts_that_cost_more_than_they_save_sleep(case):
    """The same forecasts where loads take microseconds: the misses they save are worth less than the
    time predicting takes, so the predictor sleeps most of the run and costs a fraction of its time."""
    path, inputs, want, _, accessed, dtype = case
    runs = {}
    for guarded in (False, True):
        out, runs[guarded], _ = _run(path, inputs, _steering(forecasting_sida(path), _most_used(path, accessed)),
                                     policy="learned-belady", prediction_guard=guarded, dtype=dtype)
        assert torch.equal(out, want)
    # paused once judged, for a whole sleep at least
    assert runs[True].prediction_lost_windows >= 1
    assert runs[True].prediction_paused_forwards >= _shortest_sleep(path, len({key[0] for key in accessed}))
    # asleep most of the run: this model's misses (three a forward) end a first sleep of 16 within a few
    # forwards, so its probes (9 forwards each, before sleeps of 32 and 64 misses) are most of what is left
    assert runs[True].prediction_paused_forwards > 0.6 * runs[True].forwards
    # and a fraction of its time (measured: 0.40-0.43 in float32, 0.65-0.72 in bfloat16 on an idle machine;
    # each wake-up's catch-up over the kept tokens is spent too, and its share varies with the machine's load)
    assert runs[True].predictor_seconds < 0.9 * runs[False].predictor_seconds


def test_asleep_the_shadow_waits_and_a_probe_starts_from_the_live_cache():
    """While the predictor sleeps the live cache runs as LRU and the shadow is not fed (it would cost
    a cache's bookkeeping a layer for nothing); a probe copies the live cache, experts and order, into
    the shadow and its twin."""
    live = ExpertCache(3, make_policy("learned"), n_layers=1, top_k=1, n_experts=8)
    spent = prediction_guard.Spent(0.0, 0, 0.0, 0.0, 0)
    guard = prediction_guard.PredictionGuard(live, 1, 8, 1, lambda: spent, lambda asleep: None,
                                             lambda: make_policy("learned"))
    guard._pause()
    for expert in (0, 1, 2, 3, 1):
        live.access((0, expert))
        guard.access([(0, expert)])
    assert guard.lru.stats.accesses == 0  # asleep: nothing fed
    guard._start_probe()
    assert guard.lru.eviction_order() == guard.twin.eviction_order() == live.eviction_order() == [(0, 2), (0, 3), (0, 1)]
    guard.access([(0, 4)])
    assert guard.lru.eviction_order() == [(0, 3), (0, 1), (0, 4)]  # probing: fed again
