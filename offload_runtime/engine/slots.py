"""SlotPool: the fast tier. A fixed set of expert-sized buffers on the compute device.

One tensor per expert parameter name, shaped [S, ...] (e.g. `gate_up_proj` [S, 2I, H]), so a
layer's experts module can compute straight on the pool once its expert ids are remapped to slot
ids (`SlotMap.table`). The pool only provides slots: which experts keep one is decided by
`cache.ExpertCache` in the runtime; the pool tracks free slots and the key ↔ slot mapping.

Mixed precision (`TieredSlotPool`): slots of two sizes, a fine tier (e.g. int8 experts) and a
coarse one (int4), numbered one after the other in one slot map; a key holds a slot of one tier.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import logging
import mmap
import threading
from collections.abc import Mapping, Sequence

import torch

from cache.policy import Key
from offload_runtime.engine.expert_layout import ExpertSpec
from prescient.budget import Budget
from prescient.errors import CapacityError, PrescientError

log = logging.getLogger(__name__)



class SlotError(PrescientError):
    """A slot is misused: a key assigned twice, released while absent, no slot free, a write of
    the wrong expert shape, or layers whose experts differ in shape."""


def slots_for_budget(budget: Budget | float | int | str, expert_nbytes: int, total_experts: int,
                     min_slots: int) -> int:
    """How many slots a budget buys: a `Budget`, or the Python API's shorthands (a float in (0, 1]
    is a fraction of all experts, an int is bytes, a string is read by `Budget.parse`). Capped at
    `total_experts`; below `min_slots` (one layer's top-k) is a CapacityError."""
    if isinstance(budget, int) and not isinstance(budget, bool):
        budget = Budget(budget, "bytes")
    budget = Budget.of(budget)
    slots = budget.slots(total_experts, expert_nbytes)
    if slots < min_slots:
        what = f"{budget} of {total_experts} experts" if budget.unit == "fraction" else str(budget)
        raise CapacityError(
            f"budget {what} buys {slots} expert slots; the minimum is one layer's top-k = {min_slots} slots "
            f"({min_slots * expert_nbytes} bytes, or a fraction of at least {min_slots / total_experts:.4f})"
        )
    return min(slots, total_experts)


def release_pages(tensor: torch.Tensor) -> int:
    """Hand the whole pages inside contiguous CPU `tensor` back to the kernel (`madvise(DONTNEED)`:
    anonymous pages read as zeros after); returns the bytes released (0 on another device or
    system)."""
    if tensor.device.type != "cpu" or not hasattr(mmap, "MADV_DONTNEED"):
        return 0
    start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
    first, last = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
    if last <= first:
        return 0
    if _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), mmap.MADV_DONTNEED) != 0:
        return 0
    return last - first


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _one_spec(specs: Sequence[ExpertSpec]) -> ExpertSpec:
    """The slot spec every MoE layer shares; a SlotError if they differ."""
    if any(spec != specs[0] for spec in specs):
        raise SlotError("the MoE layers' experts differ in shape or dtype, so one slot cannot hold any expert: "
                        f"{sorted({str(spec) for spec in specs})}")
    return specs[0]


class SlotMap:
    """Thread-safe key ↔ slot bookkeeping, with a [L, E] table of slot ids (-1: no slot). The
    slots may come in tiers (`tiers`: the slot count of each, numbered one tier after another).

    `rows` is the table as a NumPy array sharing its memory: the runtime's inference thread, the
    only one that assigns and releases, reads it without the lock on the decode path. With one
    tier of at least L·E slots (every expert fits), key (l, e) gets slot l·E + e, its home: a
    layer's experts then sit in E consecutive slots, as in the model's own [E, ...] tensors, and
    a layer call computes on that window of the pool (see `offloaded_experts`)."""

    def __init__(self, num_slots: int, num_layers: int, num_experts: int, tiers: Sequence[int] | None = None) -> None:
        tiers = list(tiers) if tiers is not None else [num_slots]
        if sum(tiers) != num_slots:
            raise SlotError(f"tiers of {tiers} slots do not add up to {num_slots}")
        self.num_slots = num_slots
        self.tier_starts = [sum(tiers[:i]) for i in range(len(tiers))]
        self.table = torch.full((num_layers, num_experts), -1, dtype=torch.long)
        self.rows = self.table.numpy()  # the same memory
        self.home = len(tiers) == 1 and num_slots >= num_layers * num_experts  # see the class doc
        # per tier, pop() hands out its lowest slot first
        self._free = [list(range(start + n - 1, start - 1, -1)) for start, n in zip(self.tier_starts, tiers)]
        self.retired = 0  # slots taken out of use (`retire`): the memory guard gave their memory back
        self._slot: dict[Key, int] = {}
        self._key: list[Key | None] = [None] * num_slots
        self._lock = threading.Lock()

    def assign(self, key: Key, tier: int = 0) -> int:
        """Give `key` a free slot of `tier` and return it."""
        with self._lock:
            if key in self._slot:
                raise SlotError(f"expert {key} already holds slot {self._slot[key]}")
            free = self._free[tier]
            if not free:
                raise SlotError(f"no free slot for expert {key}: all {self.num_slots} are taken; release one first")
            home = key[0] * self.table.shape[1] + key[1] if self.home else None
            if home is not None and self._key[home] is None:  # once per key: no eviction when every expert fits
                free.remove(home)
                slot = home
            else:
                slot = free.pop()
            self._slot[key], self._key[slot] = slot, key
            self.table[key] = slot
            return slot

    def tier_of(self, slot: int) -> int:
        """The tier slot `slot` belongs to."""
        return bisect.bisect_right(self.tier_starts, slot) - 1

    def release(self, key: Key) -> int:
        """Free `key`'s slot and return it."""
        with self._lock:
            if key not in self._slot:
                raise SlotError(f"expert {key} holds no slot")
            slot = self._slot.pop(key)
            self._key[slot] = None
            self.table[key] = -1
            self._free[self.tier_of(slot)].append(slot)
            return slot

    def retire(self, count: int) -> list[int]:
        """Take `count` free slots of a one-tier map out of use for good; returns them (their
        numbers stay: the slot tables' width is the pool's). A SlotError where fewer are free."""
        with self._lock:
            if len(self._free) != 1 or len(self._free[0]) < count:
                raise SlotError(f"cannot retire {count} slots: {sum(map(len, self._free))} are free")
            self.home = False  # a retired home slot would leave its key homeless
            retired, self._free[0] = self._free[0][-count:], self._free[0][:-count]
            self.retired += count
            return retired

    def slot_of(self, key: Key) -> int | None:
        with self._lock:
            return self._slot.get(key)

    def key_of(self, slot: int) -> Key | None:
        with self._lock:
            return self._key[slot]

    @property
    def free(self) -> int:
        with self._lock:
            return sum(map(len, self._free))

    def __contains__(self, key: Key) -> bool:
        with self._lock:
            return key in self._slot


class SlotPool:
    """`num_slots` expert buffers on `device`, laid out per parameter as [S, *shape]."""

    def __init__(self, spec: ExpertSpec, num_slots: int, num_layers: int, num_experts: int,
                 device: torch.device | str = "cpu", phases: Mapping[str, int] | None = None) -> None:
        if num_slots < 1:
            raise CapacityError(f"a slot pool needs at least 1 slot, got {num_slots}")
        self.spec = spec
        self.device = torch.device(device)
        # `phases`: where the store reads around the page cache, each parameter's buffers at its phase
        self.buffers = spec.empty(num_slots, device=self.device, phases=phases)
        self.map = SlotMap(num_slots, num_layers, num_experts)
        log.info("slot pool: %d slots × %.2f MiB on %s", num_slots, spec.nbytes / 2**20, self.device)

    @classmethod
    def for_budget(cls, specs: Sequence[ExpertSpec], num_experts: int, top_k: int, budget: float | int | str,
                   device: torch.device | str = "cpu", phases: Mapping[str, int] | None = None) -> "SlotPool":
        """A pool for `len(specs)` MoE layers of `num_experts` experts each (one spec per layer,
        e.g. `ExpertStore.specs`), sized by `budget` (see `slots_for_budget`)."""
        slots = slots_for_budget(budget, _one_spec(specs).nbytes, len(specs) * num_experts, top_k)
        return cls.for_slots(specs, num_experts, slots, device, phases)

    @classmethod
    def for_slots(cls, specs: Sequence[ExpertSpec], num_experts: int, slots: int,
                  device: torch.device | str = "cpu", phases: Mapping[str, int] | None = None) -> "SlotPool":
        """A pool of `slots` slots (a memory plan's count) for `len(specs)` MoE layers of
        `num_experts` experts each."""
        return cls(_one_spec(specs), slots, len(specs), num_experts, device, phases)

    @property
    def num_slots(self) -> int:
        return self.map.num_slots

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.spec.nbytes

    def tier_buffers(self) -> list[dict[str, torch.Tensor]]:
        """The buffers of each tier of slots: this pool's one."""
        return [self.buffers]

    def view(self, slot: int) -> dict[str, torch.Tensor]:
        """Slot `slot`'s tensors (views into the pool: writing them writes the slot)."""
        self._check(slot)
        return {name: buffer[slot] for name, buffer in self.buffers.items()}

    def write(self, slot: int, tensors: Mapping[str, torch.Tensor], non_blocking: bool = False) -> None:
        """Copy one expert's tensors (names and shapes of the spec) into `slot`."""
        self._check(slot)
        if tensors.keys() != self.buffers.keys():
            raise SlotError(f"expert tensors {sorted(tensors)} do not match the pool's {sorted(self.buffers)}")
        for name, tensor in tensors.items():
            if tuple(tensor.shape) != self.spec.shapes[name]:
                raise SlotError(f"{name} of shape {list(tensor.shape)} does not fit a slot's "
                                f"{list(self.spec.shapes[name])}")
            self.buffers[name][slot].copy_(tensor, non_blocking=non_blocking)

    def give_back(self, count: int) -> int:
        """Retire `count` free slots and hand their memory back to the kernel (the pages of a
        never-touched or dropped slot are not resident); returns the bytes given back."""
        freed = 0
        for slot in self.map.retire(count):
            for buffer in self.buffers.values():
                freed += release_pages(buffer[slot])
        return freed

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise SlotError(f"slot {slot} is out of range: the pool has {self.num_slots} slots")


class TieredSlotPool:
    """Mixed precision's fast tier: `pools[0]` (fine copies) and `pools[1]` (coarse ones) under
    one slot map, slot s < len(pools[0]) in the first. Each pool's own map is unused."""

    @classmethod
    def for_budget(cls, fine: Sequence[ExpertSpec], coarse: Sequence[ExpertSpec], num_experts: int, top_k: int,
                   budget: Budget | float | str, fine_share: float, device: torch.device | str = "cpu"
                   ) -> "TieredSlotPool":
        """Slots for `len(coarse)` MoE layers: `fine_share` of the budget's bytes in fine slots,
        the rest in coarse ones (which must hold one layer's top-k). A fraction or a slot count
        is one of the coarse experts' (the model's own precision)."""
        specs = [_one_spec(fine), _one_spec(coarse)]
        total = len(coarse) * num_experts
        budget = Budget.of(budget)
        nbytes = int(budget.amount) if budget.unit == "bytes" else budget.slots(total) * specs[1].nbytes
        counts = [min(int(nbytes * fine_share) // specs[0].nbytes, total)]
        counts.append(min((nbytes - counts[0] * specs[0].nbytes) // specs[1].nbytes, total))
        if counts[1] < top_k:
            raise CapacityError(f"budget {budget} leaves {counts[1]} coarse slots after {counts[0]} fine ones; "
                                f"the minimum is one layer's top-k = {top_k}: raise the budget or lower the fine share")
        if counts[0] < 1:
            raise CapacityError(f"budget {budget} buys no fine slot ({specs[0].nbytes} bytes each) at a fine share "
                                f"of {fine_share:g}; raise either")
        return cls([SlotPool(spec, n, len(coarse), num_experts, device) for spec, n in zip(specs, counts)],
                   len(coarse), num_experts)

    def __init__(self, pools: Sequence[SlotPool], num_layers: int, num_experts: int) -> None:
        self.pools = list(pools)
        self.device = self.pools[0].device
        self.map = SlotMap(sum(p.num_slots for p in self.pools), num_layers, num_experts,
                           [p.num_slots for p in self.pools])

    @property
    def num_slots(self) -> int:
        return self.map.num_slots

    @property
    def nbytes(self) -> int:
        return sum(pool.nbytes for pool in self.pools)

    def tier_buffers(self) -> list[dict[str, torch.Tensor]]:
        return [pool.buffers for pool in self.pools]

    def view(self, slot: int) -> dict[str, torch.Tensor]:
        tier = self.map.tier_of(slot)
        return self.pools[tier].view(slot - self.map.tier_starts[tier])
