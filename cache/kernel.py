"""The cache's bookkeeping, compiled: insert, evict, use, pin, over `cache.state` arrays.

`ExpertCache` calls these under its lock for every operation the runtime makes, and the simulator
calls the replay loops (`cache.replay`) built from the same functions, so one implementation
serves both. A call never evicts its own keys: they are pinned for the length of the call.
Buffers `inserted` and `evicted` (one entry per key of the call at most) return what changed.
"""

from __future__ import annotations

from cache.heap import fix, inline, jit, lowest_unpinned, push, remove
from cache.rules import MARKED, OFF_SEQUENCE, RANK_MOVED, new_phase, on_evict, on_insert, on_use
from cache.state import (
    ACCESSES, CAPACITY, KIND, LAYER_HEAPS, LEARNED, MISSES, PER_LAYER, PREFETCH_HITS, PREFETCH_INSERTS, RESIDENT,
    WASTED,
)


@inline
def heap_of(st, key):
    return st.layer[key] if st.params[LAYER_HEAPS] else 0


@inline
def partition_of(st, key):
    return st.layer[key] if st.params[PER_LAYER] else 0


@inline
def victim(st, part):
    """The lowest-ranked unpinned key of capacity partition `part`, or -1. Under a global budget
    with per-layer heaps (MRS) the layers' lowest keys are compared by S = u · scale."""
    if st.params[LAYER_HEAPS] and not st.params[PER_LAYER]:
        best, best_s = -1, 0.0
        for layer in range(len(st.heap_size)):
            key = lowest_unpinned(st, layer)
            if key >= 0:
                s = st.rank[key] * st.scale[layer]
                if best < 0 or s < best_s:  # ties: the lower layer, met first
                    best, best_s = key, s
        return best
    key = lowest_unpinned(st, part)
    if key >= 0 and st.params[KIND] == LEARNED and st.rank[key] >= MARKED:
        new_phase(st)
        key = lowest_unpinned(st, part)
    return key


@inline
def _evict(st, key):
    st.resident[key] = False
    remove(st, heap_of(st, key), key)
    on_evict(st, key)
    st.counters[RESIDENT] -= 1
    if st.unused[key]:
        st.unused[key] = False
        st.counters[WASTED] += 1


@inline
def _insert(st, key):
    st.resident[key] = True
    on_insert(st, key)
    push(st, heap_of(st, key), key)
    st.counters[RESIDENT] += 1


@inline
def load(st, keys, demand, inserted, evicted):
    """Insert the keys that are not resident, in order, evicting where a partition is full.
    A key that finds every slot pinned stops a demand load (its index is returned as `failed`)
    and is skipped by a prefetch. Returns (inserted count, evicted count, failed or -1)."""
    for key in keys:
        st.pins[key] += 1  # spared for the call
    capacity = st.params[CAPACITY]
    n_inserted = n_evicted = 0
    failed = -1
    for i in range(len(keys)):
        key = keys[i]
        if st.resident[key]:
            continue
        part = partition_of(st, key)
        if st.fill[part] < capacity:
            st.fill[part] += 1
        else:
            out = victim(st, part)
            if out < 0:
                if demand:
                    failed = i
                    break
                continue
            if not demand and st.params[KIND] == LEARNED and st.outside[key] <= st.rank[out] % MARKED:
                continue  # cost-aware: a prefetch displaces only an expert predicted less likely
            _evict(st, out)
            evicted[n_evicted] = out
            n_evicted += 1
        _insert(st, key)
        inserted[n_inserted] = key
        n_inserted += 1
    for key in keys:
        st.pins[key] -= 1
    if demand:
        st.counters[MISSES] += n_inserted
    else:
        st.counters[PREFETCH_INSERTS] += n_inserted
        for i in range(n_inserted):
            st.unused[inserted[i]] = True
    return n_inserted, n_evicted, failed


@inline
def use(st, keys):
    """Resident keys are used, in order. Returns -1, or the index of the first key off
    Belady's sequence (the keys before it are used)."""
    for key in keys:
        if st.unused[key]:
            st.unused[key] = False
            st.counters[PREFETCH_HITS] += 1
    st.counters[ACCESSES] += len(keys)
    for i in range(len(keys)):
        moved = on_use(st, keys[i])
        if moved == RANK_MOVED:
            fix(st, heap_of(st, keys[i]), keys[i])
        elif moved == OFF_SEQUENCE:
            return i
    return -1


@jit
def shrink(st, capacity, evicted):
    """Lower every partition's capacity to `capacity`, evicting its lowest-ranked unpinned keys
    until it fits (fewer where pinned keys hold the rest). Returns the evicted count."""
    st.params[CAPACITY] = capacity
    n_evicted = 0
    for part in range(len(st.fill)):
        while st.fill[part] > capacity:
            out = victim(st, part)
            if out < 0:
                break
            _evict(st, out)
            st.fill[part] -= 1
            evicted[n_evicted] = out
            n_evicted += 1
    return n_evicted


@jit
def access_many(st, keys, pin, inserted, evicted):
    """Load and use `keys`; pin them if `pin` and all went well.
    Returns (inserted count, evicted count, failed or -1, off-sequence index or -1)."""
    n_inserted, n_evicted, failed = load(st, keys, True, inserted, evicted)
    off = use(st, keys if failed < 0 else keys[:failed])
    if pin and failed < 0 and off < 0:
        for key in keys:
            st.pins[key] += 1
    return n_inserted, n_evicted, failed, off


@jit
def prefetch_many(st, keys, pin, inserted, evicted):
    """Insert `keys` ahead of use (best first), skipping what does not fit; pin the inserted
    ones if `pin`. Returns (inserted count, evicted count)."""
    n_inserted, n_evicted, _ = load(st, keys, False, inserted, evicted)
    if pin:
        for i in range(n_inserted):
            st.pins[inserted[i]] += 1
    return n_inserted, n_evicted
