"""The simulator's replay loops, compiled over the same kernel functions the runtime's calls use.

A replay is a sequence of layer-steps (token-step t, layer l at index t·L + l) held as flat arrays:
`keys[offsets[j]:offsets[j + 1]]` are the key ids layer-step j accesses, and likewise for router
scores and predicted keys. See `cache.simulator` for what is modelled.
"""

from __future__ import annotations

import numpy as np

from cache.heap import jit
from cache.kernel import load, prefetch_many, use
from cache.rules import on_router_scores


@jit
def replay_demand(st, n_layers, keys, offsets, score_keys, score_values, score_offsets, use_scores,
                  inserted, evicted):
    """Every layer-step: router scores to the policy (if `use_scores`), then the keys are loaded
    and used. Returns -1, or the access number of a key off Belady's sequence."""
    for j in range(len(offsets) - 1):
        if use_scores:
            s, e = score_offsets[j], score_offsets[j + 1]
            on_router_scores(st, j % n_layers, score_keys[s:e], score_values[s:e])
        step = keys[offsets[j]:offsets[j + 1]]
        load(st, step, True, inserted, evicted)
        off = use(st, step)
        if off >= 0:
            return offsets[j] + off
    return -1


HEAD, TAIL, PENDING = range(3)  # link[...]: the transfer queue's ends and live entries


@jit
def _cancel(evicted, n_evicted, pending, link):
    """Evicted keys leave the link."""
    for k in range(n_evicted):
        if pending[evicted[k]]:
            pending[evicted[k]] = False
            link[PENDING] -= 1


@jit
def _prefetch(st, wanted, limited, pending, serial, queue, link, inserted, evicted):
    """Issue a prefetch; with a limited link, the inserted keys queue for transfer."""
    n_inserted, n_evicted = prefetch_many(st, wanted, False, inserted, evicted)
    if limited:
        _cancel(evicted, n_evicted, pending, link)
        for k in range(n_inserted):
            key = inserted[k]
            pending[key] = True
            serial[key] = link[TAIL]  # an entry is live while the key's serial names it
            queue[link[TAIL]] = key
            link[TAIL] += 1
            link[PENDING] += 1


@jit
def _transfer(bandwidth, pending, serial, queue, link):
    """The link moves `bandwidth` queued transfers, oldest first, while a layer computes."""
    if link[PENDING] <= bandwidth:
        for q in range(link[HEAD], link[TAIL]):
            pending[queue[q]] = False
        link[:] = 0
        return
    moved = 0
    while moved < bandwidth:
        key = queue[link[HEAD]]
        if pending[key] and serial[key] == link[HEAD]:
            pending[key] = False
            link[PENDING] -= 1
            moved += 1
        link[HEAD] += 1


@jit
def replay_prefetch(st, n_layers, keys, offsets, score_keys, score_values, score_offsets, use_scores,
                    predicted, predicted_offsets, ahead, bandwidth, inserted, evicted):
    """Demand accesses plus the predicted keys prefetched `ahead` layers early; the link moves
    `bandwidth` queued transfers per layer-step (-1: unlimited, transfers are instant).
    Returns (late prefetches, -1 or the access number of a key off Belady's sequence)."""
    limited = bandwidth >= 0
    pending = np.zeros(len(st.order), np.bool_)  # prefetched, slot taken, transfer not done
    serial = np.zeros(len(st.order), np.int64)
    queue = np.empty(len(predicted) + 1, np.int64)  # transfers in issue order; stale ones skipped
    link = np.zeros(3, np.int64)
    late = 0
    for t in range((len(offsets) - 1) // n_layers):
        base = t * n_layers
        for layer in range(ahead):
            wanted = predicted[predicted_offsets[base + layer]:predicted_offsets[base + layer + 1]]
            _prefetch(st, wanted, limited, pending, serial, queue, link, inserted, evicted)
        for layer in range(n_layers):
            j = base + layer
            if use_scores:
                on_router_scores(st, layer, score_keys[score_offsets[j]:score_offsets[j + 1]],
                                 score_values[score_offsets[j]:score_offsets[j + 1]])
            step = keys[offsets[j]:offsets[j + 1]]
            if link[PENDING]:
                for key in step:
                    if pending[key]:  # still on the link: finished on demand, a stall
                        pending[key] = False
                        link[PENDING] -= 1
                        late += 1
            _, n_evicted, _ = load(st, step, True, inserted, evicted)
            _cancel(evicted, n_evicted, pending, link)
            off = use(st, step)
            if off >= 0:
                return late, offsets[j] + off
            if layer + ahead < n_layers:
                for key in step:  # the layer's experts stay pinned while it prefetches
                    st.pins[key] += 1
                wanted = predicted[predicted_offsets[j + ahead]:predicted_offsets[j + ahead + 1]]
                _prefetch(st, wanted, limited, pending, serial, queue, link, inserted, evicted)
                for key in step:
                    st.pins[key] -= 1
            if limited:
                _transfer(bandwidth, pending, serial, queue, link)
    return late, -1
