"""Indexed binary min-heaps of resident keys, ordered by (rank, tiebreak, order).

Compiled with numba; each heap is a row of `state.heap`, and `state.pos` maps a key to its place,
so a key whose rank changed is moved (`fix`) or taken out (`remove`) in O(log n).
"""

from __future__ import annotations

import numba
import numpy as np

jit = numba.njit(cache=True, nogil=True)
inline = numba.njit(cache=True, nogil=True, inline="always")  # small helpers: no call, no refcounts


@inline
def below(st, a, b):
    """Whether key a comes before key b: lower rank, then lower tiebreak, then lower key."""
    if st.rank[a] != st.rank[b]:
        return st.rank[a] < st.rank[b]
    if st.tiebreak[a] != st.tiebreak[b]:
        return st.tiebreak[a] < st.tiebreak[b]
    return st.order[a] < st.order[b]


@inline
def _place(st, part, i, key):
    st.heap[part, i] = key
    st.pos[key] = i


@inline
def _sift_up(st, part, i):
    key = st.heap[part, i]
    while i > 0:
        parent = (i - 1) >> 1
        above = st.heap[part, parent]
        if not below(st, key, above):
            break
        _place(st, part, i, above)
        i = parent
    _place(st, part, i, key)


@inline
def _sift_down(st, part, i):
    n = st.heap_size[part]
    key = st.heap[part, i]
    while True:
        child = 2 * i + 1
        if child >= n:
            break
        if child + 1 < n and below(st, st.heap[part, child + 1], st.heap[part, child]):
            child += 1
        if not below(st, st.heap[part, child], key):
            break
        _place(st, part, i, st.heap[part, child])
        i = child
    _place(st, part, i, key)


@inline
def push(st, part, key):
    i = st.heap_size[part]
    st.heap_size[part] = i + 1
    _place(st, part, i, key)
    _sift_up(st, part, i)


@inline
def remove(st, part, key):
    i = st.pos[key]
    last = st.heap_size[part] - 1
    st.heap_size[part] = last
    st.pos[key] = -1
    if i != last:
        moved = st.heap[part, last]
        _place(st, part, i, moved)
        _sift_up(st, part, i)
        _sift_down(st, part, st.pos[moved])


@inline
def fix(st, part, key):
    """Restore the heap after `key`'s rank changed either way."""
    i = st.pos[key]
    _sift_up(st, part, i)
    _sift_down(st, part, st.pos[key])


@jit
def heapify(st, part):
    """Rebuild a heap whose keys' ranks all changed."""
    for i in range(st.heap_size[part] // 2 - 1, -1, -1):
        _sift_down(st, part, i)


@jit
def lowest_unpinned(st, part):
    """The lowest key of a heap that is not pinned, or -1. O(1) when the top is free; else a
    walk over the pinned keys near the top (a free key's subtree holds only higher keys)."""
    n = st.heap_size[part]
    if n == 0:
        return -1
    top = st.heap[part, 0]
    if st.pins[top] == 0:
        return top
    best = -1
    stack = np.empty(n, np.int64)
    stack[0] = 0
    depth = 1
    while depth:
        depth -= 1
        i = stack[depth]
        key = st.heap[part, i]
        if st.pins[key] == 0:
            if best < 0 or below(st, key, best):
                best = key
            continue
        for child in (2 * i + 1, 2 * i + 2):
            if child < n:
                stack[depth] = child
                depth += 1
    return best
