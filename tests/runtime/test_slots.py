"""SlotPool sizing, key ↔ slot bookkeeping, and writes a layer can compute on."""

from __future__ import annotations

import pytest
import torch

from offload_runtime.engine.expert_layout import ExpertSpec
from offload_runtime.engine.slots import SlotError, SlotMap, SlotPool, slots_for_budget
from prescient.errors import CapacityError

SPEC = ExpertSpec({"gate_up_proj": (8, 4), "down_proj": (4, 4)},
                  {"gate_up_proj": torch.float32, "down_proj": torch.float32})
NBYTES = (8 * 4 + 4 * 4) * 4  # 192 bytes per expert


def test_spec_bytes():
    assert SPEC.nbytes == NBYTES


@pytest.mark.parametrize(
    ("budget", "slots"),
    [(0.5, 16), (0.26, 8), (1.0, 32), (NBYTES * 5, 5), (NBYTES * 5 + NBYTES - 1, 5), (NBYTES * 100, 32),
     ("1KiB", 1024 // NBYTES), ("0.96 kB", 5)],
)
def test_budget_to_slots(budget, slots):
    assert slots_for_budget(budget, NBYTES, total_experts=32, min_slots=2) == slots


@pytest.mark.parametrize("budget", [0.03, NBYTES, "100B"])
def test_budget_below_one_layers_top_k_is_a_capacity_error(budget):
    with pytest.raises(CapacityError, match=r"minimum is one layer's top-k = 2 slots \(384 bytes"):
        slots_for_budget(budget, NBYTES, total_experts=32, min_slots=2)


@pytest.mark.parametrize("budget", [1.5, 0.0, "lots"])
def test_unreadable_budget(budget):
    with pytest.raises(CapacityError):
        slots_for_budget(budget, NBYTES, total_experts=32, min_slots=2)


def test_pool_for_budget_shapes_buffers_per_parameter():
    pool = SlotPool.for_budget([SPEC] * 4, num_experts=8, top_k=2, budget=0.25)
    assert pool.num_slots == 8 and pool.nbytes == 8 * NBYTES
    assert pool.buffers["gate_up_proj"].shape == (8, 8, 4) and pool.buffers["down_proj"].shape == (8, 4, 4)
    assert pool.map.table.shape == (4, 8)


def test_layers_with_different_experts_are_refused():
    other = ExpertSpec({"gate_up_proj": (6, 4), "down_proj": (4, 3)}, SPEC.dtypes)
    with pytest.raises(SlotError, match="differ"):
        SlotPool.for_budget([SPEC, other], num_experts=8, top_k=2, budget=0.5)


def test_map_assigns_releases_and_fills_the_table():
    slots = SlotMap(num_slots=2, num_layers=2, num_experts=4)
    a, b = slots.assign((0, 3)), slots.assign((1, 1))
    assert {a, b} == {0, 1} and slots.free == 0
    assert slots.slot_of((0, 3)) == a and slots.key_of(b) == (1, 1) and (1, 1) in slots
    assert slots.table[0].tolist() == [-1, -1, -1, a]
    with pytest.raises(SlotError, match="no free slot"):
        slots.assign((0, 0))
    with pytest.raises(SlotError, match="already holds"):
        slots.assign((0, 3))
    assert slots.release((0, 3)) == a and slots.table[0, 3] == -1 and slots.key_of(a) is None
    assert slots.assign((0, 0)) == a
    with pytest.raises(SlotError, match="holds no slot"):
        slots.release((1, 2))


def test_write_then_compute_on_the_pool_by_slot_ids():
    pool = SlotPool(SPEC, num_slots=3, num_layers=1, num_experts=6)
    experts = {e: {n: torch.randn(s) for n, s in SPEC.shapes.items()} for e in range(6)}
    for e in (4, 1):
        pool.write(pool.map.assign((0, e)), experts[e])
    ids = torch.tensor([1, 4, 4])
    slot_ids = pool.map.table[0][ids]
    want = torch.stack([experts[e]["down_proj"] for e in ids.tolist()])
    assert torch.equal(pool.buffers["down_proj"][slot_ids], want)
    assert torch.equal(pool.view(int(slot_ids[0]))["gate_up_proj"], experts[1]["gate_up_proj"])


def test_write_checks_names_shapes_and_range():
    pool = SlotPool(SPEC, num_slots=2, num_layers=1, num_experts=4)
    good = {n: torch.zeros(s) for n, s in SPEC.shapes.items()}
    with pytest.raises(SlotError, match="out of range"):
        pool.write(2, good)
    with pytest.raises(SlotError, match="do not match"):
        pool.write(0, {"down_proj": good["down_proj"]})
    with pytest.raises(SlotError, match="does not fit"):
        pool.write(0, {**good, "down_proj": torch.zeros(4, 5)})
