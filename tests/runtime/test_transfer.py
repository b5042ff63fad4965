"""TransferEngine with real threads: ordering, cancelling, errors, shutdown, stats."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from offload_runtime.engine.expert_layout import ExpertSpec
from offload_runtime.engine.slots import SlotPool
from offload_runtime.engine.store import ExpertStore
from offload_runtime.engine.transfer import TransferCancelledError, TransferEngine, TransferError
from prescient.arch import find_moe_layers

SPEC = ExpertSpec({"w": (4, 2)}, {"w": torch.float32})
NBYTES = 4 * 2 * 4


class GatedStore:
    """Fills an expert with layer * 100 + expert. Each read waits for `gate` (closed: the read
    blocks, as a slow disk would); reads of `fail` raise."""

    def __init__(self, delay: float = 0.0, fail=None) -> None:
        self.gate = threading.Event()
        self.started = threading.Event()
        self.log: list[tuple[str, tuple[int, int]]] = []
        self.delay, self.fail = delay, fail

    def read(self, key, out=None):
        self.log.append(("start", key))
        self.started.set()
        assert self.gate.wait(10), "test forgot to open the gate"
        time.sleep(self.delay)
        if key == self.fail:
            raise OSError("disk on fire")
        for tensor in out.values():
            tensor.fill_(key[0] * 100 + key[1])
        self.log.append(("end", key))
        return dict(out)

    def resident(self, key):
        return None

    def stored_nbytes(self, key):
        return NBYTES

    def order(self) -> list[tuple[int, int]]:
        return [key for what, key in self.log if what == "start"]


def test_an_engine_without_workers_is_refused():
    with pytest.raises(TransferError, match="at least one worker"):
        engine_for(GatedStore(), workers=0)


def engine_for(store, slots: int = 8, workers: int = 1, **kwargs) -> TransferEngine:
    return TransferEngine(store, SlotPool(SPEC, slots, num_layers=2, num_experts=8), workers=workers, **kwargs)


def test_demand_is_served_before_prefetches_and_prefetches_by_score():
    store = GatedStore()
    with engine_for(store) as engine:
        tickets = [engine.request((0, 0), 0, priority=0.1)]
        assert store.started.wait(5)  # the worker is busy with (0, 0)
        tickets.append(engine.request((0, 1), 1, priority=0.2))
        tickets.append(engine.request((0, 2), 2, priority=0.9))
        tickets.append(engine.request((0, 3), 3, demand=True))
        tickets.append(engine.request((1, 0), 4, priority=0.5))
        store.gate.set()
        for ticket in tickets:  # not engine.wait: it would raise a prefetch to a demand
            ticket.future.result(timeout=5)
        assert store.order() == [(0, 0), (0, 3), (0, 2), (1, 0), (0, 1)]
        assert torch.equal(engine.pool.view(2)["w"], torch.full((4, 2), 2.0))
        assert torch.equal(engine.pool.view(4)["w"], torch.full((4, 2), 100.0))
        stats = engine.stats
        assert (stats.loads, stats.demand_loads, stats.prefetch_loads, stats.cancelled) == (5, 1, 4, 0)
        assert stats.bytes_moved == 5 * NBYTES


def test_wait_upgrades_a_queued_prefetch_to_demand():
    store = GatedStore()
    with engine_for(store) as engine:
        engine.request((0, 0), 0, priority=1.0)
        assert store.started.wait(5)
        engine.request((0, 1), 1, priority=0.9)
        engine.request((0, 2), 2, priority=0.1)
        waiter = threading.Thread(target=engine.wait, args=((0, 2),), kwargs={"timeout": 5})
        waiter.start()
        time.sleep(0.1)  # the waiter has upgraded (0, 2)
        store.gate.set()
        waiter.join(5)
        engine.wait((0, 1), timeout=5)
        assert store.order() == [(0, 0), (0, 2), (0, 1)]
        assert engine.stats.demand_loads == 1 and engine.stats.prefetch_loads == 2


def test_cancel_stale_drops_queued_prefetches_but_not_running_ones():
    store = GatedStore()
    with engine_for(store) as engine:
        engine.request((0, 0), 0, priority=0.5)
        assert store.started.wait(5)
        engine.request((0, 1), 1, priority=0.4)
        engine.request((0, 2), 2, priority=0.3)
        engine.request((0, 3), 3, demand=True)
        assert engine.queued == 3 and engine.pending == 4  # and (0, 0) running
        assert engine.cancel_stale(keep={(0, 2)}) == [(0, 1)]  # (0, 0) runs, (0, 3) is a demand
        assert engine.pending == 3
        assert not engine.cancel((0, 0))
        store.gate.set()
        with pytest.raises(TransferCancelledError, match=r"\(0, 1\)"):
            engine.wait((0, 1), timeout=5)
        for key in [(0, 3), (0, 0), (0, 2)]:
            engine.wait(key, timeout=5)
        assert (0, 1) not in store.order()
        assert engine.stats.cancelled == 1 and engine.stats.loads == 3 and engine.pending == 0
        assert engine.ready((0, 0)) and not engine.ready((0, 1))


def test_a_new_request_for_a_slot_supersedes_a_queued_one():
    store = GatedStore()
    with engine_for(store) as engine:
        engine.request((0, 0), 0)
        assert store.started.wait(5)
        engine.request((0, 1), 1)
        engine.request((1, 1), 1)  # (0, 1) was evicted before it loaded
        store.gate.set()
        engine.wait((1, 1), timeout=5)
        with pytest.raises(TransferCancelledError):
            engine.wait((0, 1), timeout=5)
        assert torch.equal(engine.pool.view(1)["w"], torch.full((4, 2), 101.0))


def test_copies_into_one_slot_never_overlap():
    store = GatedStore(delay=0.05)
    with engine_for(store, workers=2) as engine:
        engine.request((0, 0), 0)
        assert store.started.wait(5)
        engine.request((0, 1), 0)  # a second worker is idle, yet slot 0 is busy
        time.sleep(0.1)
        assert store.order() == [(0, 0)]
        store.gate.set()
        engine.wait((0, 1), timeout=5)
        assert store.log == [("start", (0, 0)), ("end", (0, 0)), ("start", (0, 1)), ("end", (0, 1))]
        assert torch.equal(engine.pool.view(0)["w"], torch.full((4, 2), 1.0))


def test_worker_errors_surface_in_the_caller():
    store = GatedStore(fail=(0, 1))
    store.gate.set()
    with engine_for(store) as engine:
        engine.request((0, 1), 1, demand=True)
        with pytest.raises(TransferError, match=r"\(0, 1\).*disk on fire") as raised:
            engine.wait((0, 1), timeout=5)
        assert isinstance(raised.value.__cause__, OSError)
        engine.request((0, 1), 1, priority=0.3)  # a failed prefetch nobody waits for ...
        deadline = time.monotonic() + 5
        while engine.stats.failed < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(TransferError, match="disk on fire"):  # ... is raised by the next call
            engine.request((0, 2), 2)
        engine.request((0, 2), 2)  # reported once; the engine goes on
        engine.wait((0, 2), timeout=5)
        assert engine.stats.failed == 2 and engine.stats.loads == 1


def test_close_with_queued_work_does_not_hang():
    store = GatedStore()
    engine = engine_for(store, slots=8, join_timeout=0.5)
    engine.request((0, 0), 0)
    assert store.started.wait(5)
    for expert in range(1, 8):
        engine.request((1, expert), expert, priority=expert)
    closer = threading.Thread(target=engine.close)
    start = time.monotonic()
    closer.start()
    closer.join(5)
    assert not closer.is_alive() and time.monotonic() - start < 3  # the running read never ends
    assert engine.stats.cancelled == 7
    with pytest.raises(TransferCancelledError):
        engine.wait((1, 3), timeout=1)
    with pytest.raises(TransferError, match="closed"):
        engine.request((1, 0), 0)
    engine.close()  # idempotent
    store.gate.set()  # let the daemon worker finish
    assert store.order() == [(0, 0)]


def test_stall_time_counts_waiting_for_a_slow_read():
    store = GatedStore(delay=0.2)
    store.gate.set()
    with engine_for(store) as engine:
        engine.request((0, 0), 0, demand=True)
        engine.wait((0, 0), timeout=5)
        assert 0.15 < engine.stats.stall_seconds < 2
        with pytest.raises(TransferError, match="never requested"):
            engine.wait((1, 1))


def test_engine_loads_real_experts_into_slots(tiny_moe_dir):
    path = tiny_moe_dir("mixtral")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    layers = find_moe_layers(model)
    with ExpertStore(path, model) as store:
        pool = SlotPool.for_budget(store.specs, store.num_experts, layers[0].top_k, budget=0.25)
        keys = [(1, 5), (0, 2), (1, 0)]
        with TransferEngine(store, pool, workers=2) as engine:
            for i, key in enumerate(keys):
                engine.request(key, pool.map.assign(key), priority=float(i), demand=i == 0)
            for key in keys:
                engine.wait(key, timeout=5)
        for layer, expert in keys:
            slot = pool.map.slot_of((layer, expert))
            for name, param in layers[layer].experts.named_parameters():
                assert torch.equal(pool.buffers[name][slot], param[expert])
        assert engine.stats.bytes_moved == 3 * store.expert_nbytes


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["disk", "host"])
def test_cuda_copies_on_a_side_stream(tiny_moe_dir, mode):
    """Pinned host memory (host mode) or a pinned staging buffer (disk mode) → a copy stream →
    slots the current stream may read after `wait`."""
    path = tiny_moe_dir("mixtral")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    layers = find_moe_layers(model)
    with ExpertStore(path, model, mode=mode) as store:
        if mode == "host":
            assert store.resident((0, 0))["down_proj"].is_pinned()
        pool = SlotPool.for_budget(store.specs, store.num_experts, layers[0].top_k, budget=0.5, device="cuda")
        keys = [(layer, expert) for layer in range(store.num_layers) for expert in range(0, store.num_experts, 2)]
        with TransferEngine(store, pool) as engine:
            for key in keys:
                engine.request(key, pool.map.assign(key), priority=float(key[1]))
            for key in keys:
                engine.wait(key, timeout=10)
            for layer, expert in keys:
                slot = pool.map.slot_of((layer, expert))
                for name, param in layers[layer].experts.named_parameters():
                    assert torch.equal(pool.buffers[name][slot].cpu(), param[expert])
