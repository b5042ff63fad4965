"""`--memory` holds while decoding: the plan counts what the predictor holds at work, the store's
reads leave no pages behind under a cap, and the memory guard gives slots back (their pages to
the kernel) when major faults climb, computing the same tokens."""

from __future__ import annotations

import itertools
import math

import psutil
import pytest
import torch

from cache import ExpertCache, make_policy
from offload_runtime.engine import loader, memory_guard
from offload_runtime.engine.expert_layout import expert_spec
from offload_runtime.engine.loader import load_offloaded
from offload_runtime.engine.memory_plan import MiB, reserve_bytes
from offload_runtime.engine.slots import release_pages
from prescient.errors import CapacityError
from prescient.memory_cap import READ_HEADROOM_BYTES
from prescient.loading import load_model
from prescient.model_dir import ModelDirectory
from tests.runtime.test_learned_eviction_runtime import forecasting_sida
from tests.runtime.test_memory_plan import FOOTPRINT, _model
from tests.runtime.test_offloaded_generate import encode, generate


def test_a_shrunk_cache_evicts_its_victims_down_to_the_new_capacity():
    evicted = []
    cache = ExpertCache(6, make_policy("lru"), n_layers=2, top_k=2, on_evict=evicted.append)
    cache.access_many([(0, e) for e in range(6)])
    cache.access_many([(0, 0)])  # the most recent: kept
    assert cache.shrink(3) == evicted == [(0, 1), (0, 2), (0, 3)]
    assert len(cache) == 3 and cache.capacity == 3
    cache.access_many([(1, 0)])  # a miss at the new capacity evicts one
    assert len(cache) == 3
    with pytest.raises(Exception, match="top-2"):
        cache.shrink(1)


def _anonymous() -> int:
    memory = psutil.Process().memory_info()
    return memory.rss - memory.shared


def test_released_pages_leave_the_process():
    block = torch.ones(64 * MiB // 4)  # touched: resident
    before = _anonymous()
    assert release_pages(block) > 60 * MiB
    assert _anonymous() < before - 48 * MiB
    assert float(block[len(block) // 2]) == 0.0  # whole pages read back as zeros


def _slot_cap(path, directory, slots: int, dtype: str = "float32") -> int:
    """A cap that buys `slots` slots of `dtype` beside FOOTPRINT (one transfer worker)."""
    probe = load_offloaded(path, budget=1.0, dtype=dtype)
    expert_bytes = probe.runtime.pool.spec.nbytes
    probe.runtime.close()
    return FOOTPRINT + reserve_bytes(directory.config, getattr(torch, dtype).itemsize, expert_bytes) + slots * expert_bytes


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_guard_gives_slots_back_while_faults_climb_and_the_tokens_stay_the_same(tiny_moe_dir, monkeypatch, dtype):
    path, directory, _ = _model(tiny_moe_dir, dtype)
    reference = generate(load_model(path, dtype=getattr(torch, dtype))[0], encode(path, False), 24)
    monkeypatch.setattr(loader, "process_footprint", lambda reads=True: FOOTPRINT)
    cap = _slot_cap(path, directory, 12, dtype)
    faults = itertools.count(step=5)  # five major faults per forward: a process re-reading its own pages
    monkeypatch.setattr(memory_guard, "major_faults", lambda: next(faults))
    model = load_offloaded(path, memory=cap, dtype=dtype)
    with model.runtime as runtime:
        out = generate(model, encode(path, False), 24)  # 24 forwards: the guard trips after the cold window
        stats = runtime.stats()
    assert torch.equal(out, reference)
    assert stats.slots_given_back > 0 and stats.slots == 12 - stats.slots_given_back >= runtime.top_k
    assert runtime.cache.capacity == stats.slots and len(runtime.cache) <= stats.slots


def test_the_guard_leaves_a_healthy_decode_alone(tiny_moe_dir, monkeypatch):
    path, directory, reference = _model(tiny_moe_dir)
    monkeypatch.setattr(loader, "process_footprint", lambda reads=True: FOOTPRINT)
    monkeypatch.setattr(memory_guard, "major_faults", lambda: 7)  # none since the start
    model = load_offloaded(path, memory=_slot_cap(path, directory, 12))
    with model.runtime as runtime:
        assert torch.equal(generate(model, encode(path, False)), reference)
        assert runtime.stats().slots_given_back == 0 and runtime.stats().slots == 12


def test_the_plan_leaves_room_for_what_the_predictor_holds_at_work(tiny_moe_dir, monkeypatch):
    """A predictor whose decode state holds 64 MiB: the plan measures it on a warm-up, so a cap
    that buys 12 slots without it is refused, naming a cap 64 MiB larger, which then loads."""
    path, directory, _ = _model(tiny_moe_dir)
    monkeypatch.setattr(loader, "process_footprint", lambda reads=True: FOOTPRINT)
    predictor = forecasting_sida(path)
    start = predictor.start

    def heavy_start(batch_size):
        state = start(batch_size)
        state.ballast = torch.ones(64 * MiB // 4)  # held as long as the state
        return state

    monkeypatch.setattr(predictor, "start", heavy_start)
    cap = _slot_cap(path, directory, 12)
    with pytest.raises(CapacityError, match="smallest memory that works") as refused:
        load_offloaded(ModelDirectory.open(path), predictor, memory=cap, policy="learned-belady")
    smallest = int(str(refused.value).rsplit("(", 1)[1].split("MiB")[0]) * MiB
    assert smallest >= cap + 60 * MiB
    load_offloaded(ModelDirectory.open(path), predictor, memory=smallest, policy="learned-belady").runtime.close()


def test_a_cap_the_store_cannot_open_in_is_refused_before_it_opens(tiny_moe_dir, monkeypatch):
    """Deriving the checkpoint's layout holds temporaries per element of one expert; a cap whose
    steady plan would fit but whose opening peak would not is refused before the store opens (in a
    cgroup the kernel would kill the process there), naming a cap that holds the peak."""
    path, directory, _ = _model(tiny_moe_dir)
    monkeypatch.setattr(loader, "process_footprint", lambda reads=True: FOOTPRINT)
    cap = _slot_cap(path, directory, 12)
    monkeypatch.setattr(loader, "LAYOUT_BYTES_PER_ELEMENT", 2 * READ_HEADROOM_BYTES)  # a peak past the headroom
    opened = []
    monkeypatch.setattr(loader, "ExpertStore", lambda *args, **kwargs: opened.append(1))
    with pytest.raises(CapacityError, match="smallest memory that works") as refused:
        load_offloaded(path, memory=cap)
    assert not opened
    assert int(str(refused.value).rsplit("(", 1)[1].split("MiB")[0]) * MiB > cap + READ_HEADROOM_BYTES


def test_the_store_opening_peak_is_not_counted_beside_the_slots_and_reserve_it_precedes(tiny_moe_dir, monkeypatch):
    """While the store derives its layout the process holds no slot, KV cache or read yet: a cap
    just above that peak, which holds the plan's slots and reserve apart from it, loads; a cap just
    below it is refused, naming at least the peak."""
    path, directory, _ = _model(tiny_moe_dir)
    monkeypatch.setattr(loader, "process_footprint", lambda reads=True: FOOTPRINT)
    steady = _slot_cap(path, directory, 12)  # 12 slots beside the footprint and reserve
    spec, _ = expert_spec(load_model(path)[1][0])
    elements = sum(math.prod(shape) for shape in spec.shapes.values())
    per_element = (steady + 8 * MiB - FOOTPRINT + READ_HEADROOM_BYTES) // elements  # a peak 8 MiB above it
    monkeypatch.setattr(loader, "LAYOUT_BYTES_PER_ELEMENT", per_element)
    peak = FOOTPRINT - READ_HEADROOM_BYTES + per_element * elements
    with load_offloaded(path, memory=peak + MiB) as model:  # the reserve beside the peak would not fit
        assert model.runtime.memory_plan.slots >= 12
    with pytest.raises(CapacityError, match="at its peak while the expert store opens") as refused:
        load_offloaded(path, memory=peak - MiB)
    assert int(str(refused.value).rsplit("(", 1)[1].split("MiB")[0]) * MiB >= peak
