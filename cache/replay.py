"""The simulator's replay loops, compiled over the same kernel functions the runtime's calls use.

A replay is a sequence of layer-steps (token-step t, layer l at index t·L + l) held as flat arrays:
`keys[offsets[j]:offsets[j + 1]]` are the key ids layer-step j accesses, and likewise for router
scores and predicted keys; forecasts (key ids and predicted chances of use, for learned
eviction) are per token-step t and reach the policy as the token-step starts, and their chances
of use by later tokens (if given) as each layer of it has run. See
`cache.simulator` for what is modelled.
"""

from __future__ import annotations

import numpy as np

from cache.heap import inline, jit
from cache.kernel import load, prefetch_many, use
from cache.rules import on_forecast, on_router_scores
from cache.timing import copies_in_time, hideable


@inline
def _forecast(st, t, fc_keys, fc_values, fc_offsets):
    """Token-step t's forecasts to the policy (none when the replay has none)."""
    if t + 1 < len(fc_offsets):
        on_forecast(st, fc_keys[fc_offsets[t]:fc_offsets[t + 1]], fc_values[fc_offsets[t]:fc_offsets[t + 1]])


@inline
def _forecast_run(st, t, layer, fc_keys, fc_later, fc_offsets):
    """Token-step t has run `layer`: that layer's keys take their chances of use by later tokens
    (none when the replay has none)."""
    if len(fc_later) and t + 1 < len(fc_offsets):
        s, e = fc_offsets[t], fc_offsets[t + 1]
        on_forecast(st, fc_keys[s:e], fc_later[s:e], layer)


@jit
def replay_demand(st, n_layers, keys, offsets, score_keys, score_values, score_offsets, use_scores,
                  fc_keys, fc_values, fc_later, fc_offsets, inserted, evicted):
    """Every layer-step: forecasts (as a token-step starts) and router scores (if `use_scores`)
    to the policy, then the keys are loaded and used. Returns -1, or the access number of a key
    off Belady's sequence."""
    for j in range(len(offsets) - 1):
        if j % n_layers == 0:
            _forecast(st, j // n_layers, fc_keys, fc_values, fc_offsets)
        if use_scores:
            s, e = score_offsets[j], score_offsets[j + 1]
            on_router_scores(st, j % n_layers, score_keys[s:e], score_values[s:e])
        step = keys[offsets[j]:offsets[j + 1]]
        load(st, step, True, inserted, evicted)
        off = use(st, step)
        if off >= 0:
            return offsets[j] + off
        _forecast_run(st, j // n_layers, j % n_layers, fc_keys, fc_later, fc_offsets)
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
                    fc_keys, fc_values, fc_later, fc_offsets, predicted, predicted_offsets, layers_ahead, bandwidth,
                    inserted, evicted):
    """Demand accesses plus the predicted keys prefetched `layers_ahead` layers early; the link moves
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
        _forecast(st, t, fc_keys, fc_values, fc_offsets)
        for layer in range(layers_ahead):
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
            _forecast_run(st, t, layer, fc_keys, fc_later, fc_offsets)
            if layer + layers_ahead < n_layers:
                for key in step:  # the layer's experts stay pinned while it prefetches
                    st.pins[key] += 1
                wanted = predicted[predicted_offsets[j + layers_ahead]:predicted_offsets[j + layers_ahead + 1]]
                _prefetch(st, wanted, limited, pending, serial, queue, link, inserted, evicted)
                for key in step:
                    st.pins[key] -= 1
            if limited:
                _transfer(bandwidth, pending, serial, queue, link)
    return late, -1


# --- the timed replay: a clock, and one link whose queue serves demand loads first ---------------
NOW, FREE, STALL = range(3)  # clock[...]: simulated time, when the link is next idle, stall time
DEMAND, PREFETCH, WASTED_LOADS = range(3)  # loads[...]: started transfers, prefetches moved unused
CUR, END, TOKEN = range(3)  # a queue segment: its next entry, its end, the token-step that issued it


@inline
def _start_copy(chan, at, copy_s):
    """Start a copy on the link's first idle channel, at `at` or when that channel frees; a copy
    that starts with n - 1 others in flight takes `copy_s[n - 1]`. Returns when it ends."""
    i = np.argmin(chan)
    start = max(chan[i], at)
    n = 1
    for c in range(len(chan)):
        if c != i and chan[c] > start:
            n += 1
    chan[i] = start + copy_s[n - 1]
    return chan[i]


@inline
def _layer_end(step, done, now, compute_s, expert_s, pipeline, arrivals):
    """When layer-step `step`, started at `now`, starts computing and when it ends. Per layer:
    once its last copy lands, it computes `compute_s`. Pipelined (the runtime's `expert_pipeline`): its experts
    resident at `now` compute first, then each other one as its copy lands, in arrival order,
    each `expert_s / len(step)`; the rest of the layer's compute (`compute_s - expert_s`:
    attention, router, which in the runtime run before the copies are requested) after them."""
    if not pipeline or len(step) == 0:
        ready = now
        for key in step:
            ready = max(ready, done[key])
        return ready, ready + compute_s
    each = expert_s / len(step)
    t = now
    n = 0
    for key in step:
        if done[key] > now:
            arrivals[n] = done[key]
            n += 1
        else:
            t += each
    for landed in np.sort(arrivals[:n]):
        t = max(t, landed) + each
    return now, t + compute_s - expert_s


@inline
def _live(seg, d, q_key, queued, serial):
    """Segment d's first live entry (its cursor moved past cancelled ones), or its end."""
    c, end = seg[d, CUR], seg[d, END]
    while c < end and not (queued[q_key[c]] and serial[q_key[c]] == c):
        c += 1
    seg[d, CUR] = c
    return c


@inline
def _next_prefetch(seg, depth, q_key, q_time, queued, serial, free):
    """The queued prefetch the link takes when idle at `free`: of those issued by then, the
    newest token-step's first (the runtime ranks a newer forward's prefetches first, then by
    issue order); if none was issued by then, the earliest. Drops emptied segments.
    Returns (entry, segment, depth) with entry -1 when the queue is empty."""
    earliest, earliest_d = -1, -1
    d = depth - 1
    while d >= 0:
        c = _live(seg, d, q_key, queued, serial)
        if c == seg[d, END]:  # emptied for good: a segment only grows while it is the top one
            for i in range(d, depth - 1):
                seg[i] = seg[i + 1]
            depth -= 1
            if earliest_d > d:
                earliest_d -= 1
        elif q_time[c] <= free:
            return c, d, depth
        else:  # lower segments were issued earlier
            earliest, earliest_d = c, d
        d -= 1
    return earliest, earliest_d, depth


@inline
def _advance(until, chan, copy_s, seg, tq, q_key, q_time, queued, serial, done, moved, loads):
    """Start, in the link's order, every queued prefetch the link takes before `until`."""
    while True:
        free = chan.min()
        c, d, depth = _next_prefetch(seg, tq[1], q_key, q_time, queued, serial, free)
        tq[1] = depth
        if c < 0:
            return
        if max(free, q_time[c]) >= until:
            return
        key = q_key[c]
        queued[key] = False
        done[key] = _start_copy(chan, q_time[c], copy_s)
        moved[key] = True
        loads[PREFETCH] += 1
        seg[d, CUR] = c + 1


@inline
def _evicted(evicted, n_evicted, queued, moved, loads):
    """Evicted keys leave the queue (a started copy completes: wasted if it was never used)."""
    for k in range(n_evicted):
        key = evicted[k]
        queued[key] = False
        if moved[key]:
            moved[key] = False
            loads[WASTED_LOADS] += 1


@inline
def _issue(st, wanted, token, issued, seg, tq, q_key, q_time, queued, serial, moved, loads, inserted, evicted):
    """Prefetch `wanted` at time `issued`: the inserted keys join token-step `token`'s segment."""
    n_inserted, n_evicted = prefetch_many(st, wanted, False, inserted, evicted)
    _evicted(evicted, n_evicted, queued, moved, loads)
    if n_inserted == 0:
        return
    tail, depth = tq[0], tq[1]
    if depth == 0 or seg[depth - 1, TOKEN] != token:
        seg[depth, CUR], seg[depth, END], seg[depth, TOKEN] = tail, tail, token
        depth += 1
    for k in range(n_inserted):
        key = inserted[k]
        q_key[tail], q_time[tail] = key, issued
        serial[key] = tail  # an entry is live while its key is queued and its serial names it
        queued[key] = True
        tail += 1
    seg[depth - 1, END] = tail
    tq[0], tq[1] = tail, depth


@inline
def _hideable(st, wanted, now, layers_ahead, compute_s, transfer_s, seg, depth, q_key, queued, serial, chan):
    """`wanted` less the non-resident keys whose copy would not end before their layer starts,
    `layers_ahead` layer computes after `now`, behind the copies in flight and the queued
    prefetches, the link moving one copy per `transfer_s` (the rule: `cache.timing.hideable`)."""
    backlog = 0
    for d in range(depth):
        for c in range(seg[d, CUR], seg[d, END]):
            if queued[q_key[c]] and serial[q_key[c]] == c:
                backlog += 1
    room = copies_in_time(now + layers_ahead * compute_s - max(chan.min(), now), transfer_s, backlog)
    return wanted[hideable(st.resident[wanted], room)[0]]


@jit
def replay_timed(st, n_layers, keys, offsets, score_keys, score_values, score_offsets, use_scores,
                 fc_keys, fc_values, fc_later, fc_offsets, predicted, predicted_offsets, next_predicted, next_offsets,
                 layers_ahead, compute_s, expert_s, pipeline, copy_s, transfer_s, hide_only, inserted, evicted, clock,
                 loads):
    """`replay_prefetch` (or `replay_demand`, with no predicted keys) on a clock: each layer-step
    computes `compute_s`, `expert_s` of it its experts', once its experts are in or, with
    `pipeline`, each expert as it lands (`_layer_end`); the link keeps up to len(copy_s) copies in
    flight, one taking copy_s[n - 1] when n run at once, and moves one per `transfer_s` for the
    hide-only rule (see `cache.simulator`); with `hide_only` a prefetch is issued only if its copy
    can end before its layer starts (`_hideable`). Cross-token prefetch, when `next_predicted` holds keys
    (per layer-step (t, l): those forecast at token t for (t+1, l)): a layer `layers_ahead` steps on
    that falls in the next token is prefetched from them. Fills `clock` and `loads`; returns
    (late prefetches, -1 or the access number of a key off Belady's sequence)."""
    n_keys = len(st.order)
    queued = np.zeros(n_keys, np.bool_)  # prefetched, slot taken, copy not started
    serial = np.zeros(n_keys, np.int64)
    done = np.zeros(n_keys, np.float64)  # when the key's last started copy ends
    moved = np.zeros(n_keys, np.bool_)  # copied by a prefetch, not used since
    n_issuable = len(predicted) + len(next_predicted) + 1
    q_key = np.empty(n_issuable, np.int64)  # prefetches in issue order
    q_time = np.empty(n_issuable, np.float64)
    seg = np.zeros((n_issuable, 3), np.int64)  # a stack of per-token-step queue segments
    tq = np.zeros(2, np.int64)  # entries issued, segments on the stack
    waits = np.empty(len(inserted), np.int64)
    arrivals = np.empty(len(inserted), np.float64)
    chan = np.zeros(len(copy_s), np.float64)  # when each of the link's channels is next idle
    crossing = len(next_offsets) > 1
    prefetching = len(predicted) > 0 or len(next_predicted) > 0  # cross-token alone too
    n_steps = (len(offsets) - 1) // n_layers
    late = 0
    for t in range(n_steps):
        base = t * n_layers
        _forecast(st, t, fc_keys, fc_values, fc_offsets)
        for layer in range(layers_ahead if prefetching else 0):
            wanted = predicted[predicted_offsets[base + layer]:predicted_offsets[base + layer + 1]]
            if hide_only:
                wanted = _hideable(st, wanted, clock[NOW], layer, compute_s, transfer_s, seg, tq[1], q_key, queued,
                                   serial, chan)
            _issue(st, wanted, t, clock[NOW], seg, tq, q_key, q_time, queued, serial, moved, loads, inserted, evicted)
        for layer in range(n_layers):
            j = base + layer
            now = clock[NOW]
            _advance(now, chan, copy_s, seg, tq, q_key, q_time, queued, serial, done, moved, loads)
            if use_scores:
                on_router_scores(st, layer, score_keys[score_offsets[j]:score_offsets[j + 1]],
                                 score_values[score_offsets[j]:score_offsets[j + 1]])
            step = keys[offsets[j]:offsets[j + 1]]
            n_waits = 0
            for key in step:
                if queued[key]:  # its layer waits for it: a demand load now, ahead of the prefetches
                    queued[key] = False
                    waits[n_waits] = key
                    n_waits += 1
            n_inserted, n_evicted, _ = load(st, step, True, inserted, evicted)
            _evicted(evicted, n_evicted, queued, moved, loads)
            for k in range(n_inserted):  # behind the copies in flight, if any
                done[inserted[k]] = _start_copy(chan, now, copy_s)
            for k in range(n_waits):
                done[waits[k]] = _start_copy(chan, now, copy_s)
            loads[DEMAND] += n_inserted + n_waits
            for key in step:
                if done[key] > now:
                    late += 1
            late -= n_inserted  # the misses are stalls, not late prefetches
            ready, end = _layer_end(step, done, now, compute_s, expert_s, pipeline, arrivals)
            clock[STALL] += max(end - now - compute_s, 0.0)  # prefetches go out at `ready`, as its compute starts
            off = use(st, step)
            if off >= 0:
                return late, offsets[j] + off
            _forecast_run(st, t, layer, fc_keys, fc_later, fc_offsets)
            for key in step:
                moved[key] = False
            target = layer + layers_ahead  # the layer prefetched for, counted on into the next token
            if prefetching and (target < n_layers or crossing and t + 1 < n_steps):
                for key in step:  # the layer's experts stay pinned while it prefetches
                    st.pins[key] += 1
                if target < n_layers:
                    wanted = predicted[predicted_offsets[j + layers_ahead]:predicted_offsets[j + layers_ahead + 1]]
                else:
                    wanted = next_predicted[next_offsets[base + target - n_layers]:
                                            next_offsets[base + target - n_layers + 1]]
                if hide_only:
                    wanted = _hideable(st, wanted, ready, layers_ahead, compute_s, transfer_s, seg, tq[1], q_key,
                                       queued, serial, chan)
                _issue(st, wanted, t, ready, seg, tq, q_key, q_time, queued, serial, moved, loads, inserted, evicted)
                for key in step:
                    st.pins[key] -= 1
            clock[NOW] = end
    _advance(clock[NOW], chan, copy_s, seg, tq, q_key, q_time, queued, serial, done, moved, loads)
    clock[FREE] = chan.max()
    return late, -1
