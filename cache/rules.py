"""Each policy's ordering rule: how a key's rank is set on insertion, moved by a use, kept on
eviction, and (MRS) moved by router scores. The victim is always the lowest-ranked evictable key
(`cache.heap`); the bookkeeping around these rules is `cache.kernel`'s.

- FIFO: rank = tick of insertion.            - LRU: rank = tick of the last use or insertion.
- LFU: rank = uses since insertion, tiebreak = tick of the last use (least recent goes first).
- static-hot: rank = the expert's frequency on a training trace, fixed.
- Belady: rank = −(position of the next use); a key off the sequence ranks −len(sequence).
- MRS: rank = u, with S = u · scale[layer]; a layer-step scales S by (1−α) through `scale`
  (the order within a layer is unchanged) and adds α·s to the top-p experts' S.
- learned: rank = the predicted chance of use soon (in [0, 1], from the predictor's forecasts,
  `on_forecast`), tiebreak = tick of the last use, so the key predicted least is evicted first
  and unpredicted keys go least recently used first. Once a token has run a layer, that layer's
  keys take their chance of use by later tokens (`on_forecast` with `layer`). With marking
  (Lykouris & Vassilvitskii's predictive marker) a use also adds MARKED: keys used in the current
  phase are evicted only once no unmarked key is left, which then starts a new phase
  (`new_phase`).
"""

from __future__ import annotations

import numpy as np

from cache.heap import fix, heapify, inline, jit
from cache.state import (
    ALPHA, BELADY, CURSOR, DECAY, FIFO, KIND, LEARNED, LFU, LRU, MARKING, MRS, STATIC, TICK, TOP_P,
)

_RESCALE_BELOW = 1e-120  # fold a layer's scale into its u before (1-α)^steps underflows
RANK_MOVED, OFF_SEQUENCE = 1, -1
MARKED = 2.0  # added to a learned key's rank while it is marked; its scores lie in [0, 1]


@inline
def _tick(st):
    st.counters[TICK] += 1
    return st.counters[TICK]


@inline
def on_insert(st, key):
    kind = st.params[KIND]
    if kind == FIFO or kind == LRU:
        st.rank[key] = _tick(st)
    elif kind == LFU:
        st.rank[key] = 0.0
        st.tiebreak[key] = _tick(st)
    elif kind == STATIC or kind == BELADY:
        st.rank[key] = st.outside[key]
    elif kind == LEARNED:  # unmarked: a prefetch is no request; a demand load's use marks it
        st.rank[key] = st.outside[key]
        st.tiebreak[key] = _tick(st)
    # MRS: u is kept for every key, resident or not


@inline
def on_use(st, key):
    """A resident key is used. Returns RANK_MOVED if its rank changed (the heap must be fixed),
    OFF_SEQUENCE if Belady's sequence does not hold this key next, else 0."""
    kind = st.params[KIND]
    if kind == LRU:
        st.rank[key] = _tick(st)
        return RANK_MOVED
    if kind == LFU:
        st.rank[key] += 1.0
        st.tiebreak[key] = _tick(st)
        return RANK_MOVED
    if kind == LEARNED:
        st.rank[key] = st.outside[key] + (MARKED if st.params[MARKING] else 0.0)
        st.tiebreak[key] = _tick(st)
        return RANK_MOVED
    if kind == BELADY:
        i = st.counters[CURSOR]
        if i >= len(st.future) or st.future[i] != key:
            return OFF_SEQUENCE
        st.rank[key] = -float(st.following[i])
        st.counters[CURSOR] = i + 1
        return RANK_MOVED
    return 0


@inline
def on_evict(st, key):
    if st.params[KIND] == BELADY:
        st.outside[key] = st.rank[key]  # unused until it is back: its next use holds


@jit
def on_router_scores(st, layer, keys, scores):
    """MRS: one layer-step's router scores (`keys` their key ids). Other policies ignore them.
    MRS keeps one heap per layer (its u are scaled per layer), so the layer is the heap."""
    if st.params[KIND] != MRS:
        return
    p = int(st.params[TOP_P])
    chosen = np.arange(len(keys))
    if len(keys) > p:
        chosen = np.argsort(-scores, kind="mergesort")[:p]  # stable: ties keep their order
    scale = st.scale[layer] * st.params[DECAY]
    if scale < _RESCALE_BELOW:
        for key in range(len(st.layer)):
            if st.layer[key] == layer:
                st.rank[key] *= scale
        heapify(st, layer)
        scale = 1.0
    st.scale[layer] = scale
    gain = st.params[ALPHA] / scale
    for i in chosen:
        key = keys[i]
        st.rank[key] += gain * scores[i]
        if st.pos[key] >= 0:
            fix(st, layer, key)


@jit
def on_forecast(st, keys, scores, layer=-1):
    """Learned eviction: the predicted chance of use soon of `keys` (ids), each in [0, 1], replaces
    their previous one; resident keys keep their mark. `layer` >= 0: only that layer's keys take
    theirs. Other policies ignore forecasts."""
    if st.params[KIND] != LEARNED:
        return
    for i in range(len(keys)):
        key = keys[i]
        if layer >= 0 and st.layer[key] != layer:
            continue
        st.outside[key] = scores[i]
        if st.pos[key] >= 0:
            st.rank[key] = scores[i] + (MARKED if st.rank[key] >= MARKED else 0.0)
    for part in range(len(st.heap_size)):
        heapify(st, part)


@jit
def new_phase(st):
    """Predictive marker: every key is marked, so a new phase begins with none marked."""
    for part in range(len(st.heap_size)):
        for i in range(st.heap_size[part]):
            key = st.heap[part, i]
            if st.rank[key] >= MARKED:
                st.rank[key] -= MARKED
        heapify(st, part)
