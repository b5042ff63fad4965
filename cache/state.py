"""The cache's state as flat arrays, which the compiled kernels (`cache.kernel`) work on.

`StateArrays` holds the numpy arrays, which Python code reads and writes in place, and `struct`, a
numba StructRef over the same memory that compiled functions pass as one reference (a tuple of
arrays would cost a reference count per array on every call).

Keys `(layer, expert)` are numbered densely (`ExpertCache` owns the numbering); every per-key
field is an array indexed by that id. A policy's order is a rank per key, compared as
(`rank`, `tiebreak`, `order`): `order` is the key's own tuple order, so ties go to the lower key.
Resident keys sit in an indexed binary min-heap per heap partition (one per layer, or one for
the whole cache), so finding, moving or removing a key costs O(log n).
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import fields as dataclass_fields

import numpy as np
from numba import types
from numba.experimental import structref

# policy kinds: the kernels branch on these (see cache.rules)
FIFO, LRU, LFU, STATIC, BELADY, MRS, LEARNED = range(7)

# counters[...]
TICK, ACCESSES, MISSES, PREFETCH_INSERTS, PREFETCH_HITS, WASTED, RESIDENT, CURSOR = range(8)
N_COUNTERS = 8

# params[...]
KIND, CAPACITY, PER_LAYER, LAYER_HEAPS, ALPHA, DECAY, TOP_P, MARKING = range(8)
N_PARAMS = 8


@structref.register
class CacheStateType(types.StructRef):
    def preprocess_fields(self, fields):
        return tuple((name, types.unliteral(typ)) for name, typ in fields)


class CacheState(structref.StructRefProxy):
    """What the kernels are given: a reference to the arrays of a `StateArrays`."""


@dataclass(eq=False)
class StateArrays:
    """The state's arrays (Python reads and writes them in place) and `struct`, the one
    reference to them that compiled code is passed."""

    # per key id
    order: np.ndarray  # int64: layer << 32 | expert, the keys' tuple order
    layer: np.ndarray  # int64
    resident: np.ndarray  # bool
    pins: np.ndarray  # int64 pin count
    unused: np.ndarray  # bool: prefetched and not used since
    pos: np.ndarray  # int64 place in its heap, -1 when not resident
    rank: np.ndarray  # float64 primary rank (MRS: u = S / scale[layer], kept while evicted)
    tiebreak: np.ndarray  # int64 secondary rank (LFU: tick of the last use)
    outside: np.ndarray  # float64 rank on (re)insertion: static frequency, Belady's next use, learned score
    # per heap partition (layer, or 0 for one heap over the whole cache)
    heap: np.ndarray  # int64 [partitions, capacity] key ids
    heap_size: np.ndarray  # int64 [partitions]
    # per capacity partition (layer under a per-layer budget, else 0), and per layer
    fill: np.ndarray  # int64: keys inserted while the partition had free slots
    scale: np.ndarray  # float64: MRS's per-layer scale, S = u * scale
    counters: np.ndarray  # int64 [N_COUNTERS]
    params: np.ndarray  # float64 [N_PARAMS]
    future: np.ndarray  # int64: Belady's access sequence, as key ids
    following: np.ndarray  # int64: Belady: position of the next use of the key used at i

    def __post_init__(self) -> None:
        self.struct = CacheState(*(getattr(self, name) for name in FIELDS))

    def replaced(self, **changes: np.ndarray) -> "StateArrays":
        """The same arrays but `changes`."""
        return StateArrays(**({name: getattr(self, name) for name in FIELDS} | changes))


FIELDS = tuple(f.name for f in dataclass_fields(StateArrays))
structref.define_proxy(CacheState, CacheStateType, list(FIELDS))


def new_state(n_keys: int, n_layers: int, params: np.ndarray) -> StateArrays:
    """Empty state with room for `n_keys` keys and `n_layers` layers."""
    capacity = int(params[CAPACITY])
    partitions = n_layers if params[LAYER_HEAPS] else 1
    return StateArrays(
        order=np.zeros(n_keys, np.int64),
        layer=np.zeros(n_keys, np.int64),
        resident=np.zeros(n_keys, np.bool_),
        pins=np.zeros(n_keys, np.int64),
        unused=np.zeros(n_keys, np.bool_),
        pos=np.full(n_keys, -1, np.int64),
        rank=np.zeros(n_keys, np.float64),
        tiebreak=np.zeros(n_keys, np.int64),
        outside=np.zeros(n_keys, np.float64),
        heap=np.zeros((partitions, capacity), np.int64),
        heap_size=np.zeros(partitions, np.int64),
        fill=np.zeros(n_layers if params[PER_LAYER] else 1, np.int64),
        scale=np.ones(n_layers, np.float64),
        counters=np.zeros(N_COUNTERS, np.int64),
        params=params,
        future=np.zeros(0, np.int64),
        following=np.zeros(0, np.int64),
    )


def grown(state: StateArrays, n_keys: int, n_layers: int) -> StateArrays:
    """A copy of `state` with room for at least `n_keys` keys and `n_layers` layers."""
    bigger = new_state(max(n_keys, len(state.order)), max(n_layers, len(state.scale)), state.params)
    kept = {}
    for name in FIELDS:
        old, new = getattr(state, name), getattr(bigger, name)
        if name in ("counters", "params", "future", "following") or new.shape == old.shape:
            kept[name] = old
        else:
            new[tuple(slice(0, n) for n in old.shape)] = old
            kept[name] = new
    return StateArrays(**kept)
