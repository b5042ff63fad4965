"""The prediction guard: the runtime acts on its predictor only while that pays, in experts loaded
and in time.

A learned policy and its prefetches pay only where the forecasts are right: where they are
wrong, learned eviction drops what LRU would have kept and the prefetches read experts nobody
uses, so the run moves more bytes than it would without a predictor (on runs/tw at 1.1 GB, 357
loads against LRU's 96 for one prompt). And where LRU already hits well, right forecasts save a
few loads that cost less than running the predictor does (a profile of runs/tb at 0.85 GB: 4 loads
saved in 96 tokens, slower than LRU all the same). The guard keeps a shadow of the live cache, the
same `ExpertCache` over the same accesses and capacity with LRU's policy (bookkeeping only:
nothing is copied), while the runtime acts on predictions or probes them; while the predictor sleeps
the live cache runs as LRU itself, and the shadow is not fed.

**Probes, in the shadow.** After a pause (below) the predictor sleeps (`HashBuilder.sleep`: it
keeps the last tokens it is handed and catches up over them when woken, costing nothing meanwhile)
until the live cache (LRU meanwhile) has missed `PROBE_AFTER` experts: what prediction could save
(a sleep counted in forwards woke for nothing where LRU missed nothing, and late where the misses came
back: on runs/tb at 0.66 GB, prompt 4, a loop LRU holds whole and then code, loaded 324-355 experts
sleeping 32 forwards against LRU's 360, and 290 sleeping 32 misses, results/bench-prediction-tb-0.66-
asleep-free.json and bench-prediction-tb-miss-sleep.json); then a *probe* runs the predictions in the shadow while the live cache
goes on as LRU (a learned policy without forecasts is LRU by its tiebreak): the LRU shadow restarts
as a copy of the live cache, and for `SHADOW_WINDOW` forwards a twin of it (its experts in its
order, under the live policy) takes the forecasts and what the prefetcher would prefetch (in time,
nothing copied), judged from the forward after the one that wakes the predictor (its catch-up over
the kept tokens is spent whatever the probe finds): the runtime acts again as soon as the twin has
missed at least `SHADOW_GAIN` experts fewer than the LRU shadow on the same accesses, and those
misses, at this run's wait per miss, outweigh the time the probe spent predicting (each forward
the probe runs on after it has won is one more of LRU where prediction pays); if the window ends
without that, the predictor sleeps again, each lost probe doubling the sleep. The first sleep is
short (16 misses): a pause for its cost alone falls where LRU misses nothing (a loop the cache holds
whole), and the misses that end it are where the predictions pay (runs/tw's prompt 4, a loop then
code: 145 loads at 1.7 GB and 327 at 1.1 GB sleeping 32 misses and probing 9 forwards,
results/bench-prediction-tw-miss-sleep.json; 137 and 310-315 now, -tw-early-probe.json; the
oracle 104 and 275). A probe costs a few forwards of predicting, never a miss: probes that acted
on the live cache lost their window's misses each time (on runs/tb at 0.66 GB a prompt LRU decodes
at 135 tok/s ran 0.75x without the predictor, results/bench-prediction-tb-fused.json). The runtime acts from the first forward of each sequence (a
batch-1 run judges each prompt afresh, `start_sequence`): probing from the start measured slower in
the median (see `PredictionGuard.__init__`).

**Acting, judged live.** While it acts, the guard adds up, as moving sums over about `WINDOW`
forwards:
- experts: how many more the live cache loaded (demand loads and prefetches) than LRU missed;
- time: the live run's predicting plus its demand loads beyond LRU's misses, each at the run's own
  wait per demand load (counts, not the waits measured in the window: a disk's slow spell doubles a
  load's wait for a few forwards, which read as a loss and paused predictions that were saving loads,
  runs/tw at 1.1 GB, prompt 7, results/bench-prediction-tw-early-probe.json; a prefetch in time is
  no demand load, and a wrong one counts in the experts' sum).
Either sum above `SLACK` experts (or their time), plus `SLACK_SHARE` of LRU's own misses in the
window, pauses predictions (a fixed slack alone paused right predictions on the noise of a
prompt's first tokens). A third, steadier sum over `COST_WINDOW` forwards catches a small cost that
persists (those two saturate at `WINDOW` times a forward's cost, under their slack: on runs/tb at
0.66 GB a prompt LRU decodes at 146 tok/s ran a millisecond a token of predictions to save 0.01
loads, 0.89x): the same time, against `COST_SHARE` of the forwards' own time (sleeping 128
forwards after a pause for the cost alone was measured and not kept: a prompt whose predictions pay
was paused at its 20th forward and lost its 1.5x, results/bench-prediction-tb-costsleep.json). A pause clears the
live cache's learned ranks, stops prefetching and puts the predictor to sleep until the next probe.
So a wrong (or too costly) predictor costs its first window, then a few forwards of predicting in
ever longer sleeps: never far below its classic twin, as the robust learned-caching literature asks of a learned policy.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from cache import EvictionPolicy, ExpertCache, Key, make_policy

log = logging.getLogger(__name__)

WINDOW = 16  # forwards the comparison remembers (an exponential moving sum with this time constant)
SLACK = 4.0  # experts (or their wait) more than LRU's within the window before predictions count as losing
SLACK_SHARE = 0.1  # and this share of LRU's misses in the window
PROBE_AFTER = 16  # experts the live cache misses asleep after a pause before the probe; each lost probe doubles it
WARMUP = 4  # forwards acting before a judgement (after each probe that held)
COST_WINDOW = 32  # forwards the cost comparison remembers
COST_SHARE = 0.02  # of the forwards' time: the net cost of acting on predictions that pauses them
SHADOW_WINDOW = 8  # forwards a probe runs the predictions in the shadow
SHADOW_GAIN = 2  # misses fewer than LRU's in a probe's window that make the runtime act again


class Spent(NamedTuple):
    """What the live run has spent so far: seconds waiting for copies, demand loads (copies it
    waited for), seconds of prediction on the inference thread, and seconds copying over loads."""

    stall_seconds: float
    demand_loads: int
    predictor_seconds: float
    copy_seconds: float
    loads: int

    def per_miss(self) -> float:
        """What a miss costs this run: its wait per demand load; before any, a copy's time."""
        if self.demand_loads:
            return self.stall_seconds / self.demand_loads
        return self.copy_seconds / self.loads if self.loads else 0.0


class PredictionGuard:
    """The LRU shadow of the live cache and whether the runtime acts on predictions now
    (`acting`), or runs them in the shadow (`shadowing`: a probe). `spent` reads the live run's
    costs; `sleep(True/False)` puts the predictor to sleep or wakes it; `twin_policy` makes the
    live cache's policy afresh (a probe's twin). `on_forecast` and `in` stand in for the live cache
    where the prefetcher feeds forecasts."""

    def __init__(self, cache: ExpertCache, n_layers: int, n_experts: int, top_k: int,
                 spent: Callable[[], Spent], sleep: Callable[[bool], None],
                 twin_policy: Callable[[], EvictionPolicy], clock: Callable[[], float] = time.perf_counter) -> None:
        self.cache, self.spent, self.sleep, self.twin_policy, self.clock = cache, spent, sleep, twin_policy, clock
        self.lru = ExpertCache(cache.capacity, make_policy("lru"), n_layers=n_layers, top_k=top_k,
                               n_experts=n_experts)
        self.n_layers, self.n_experts, self.top_k = n_layers, n_experts, top_k
        # acting from the start, then judged live; probes after a pause run in the shadow. Probing from the start
        # lost more than it saved: on runs/tb over 8 prompts the median ratio over no predictor was 1.16 and 0.97
        # at 0.66 and 0.85 GB probing over the prompt's forward (results/bench-prediction-tb-shadow-prompt.json),
        # 1.09 and 1.01 from the first decoded token (-shadow-decode.json), against 1.26 and 1.05 acting first
        # with live probes (-fused.json)
        self.acting = True
        self.twin: ExpertCache | None = None  # a probe's learned twin of the LRU shadow, while `shadowing`
        self.paused_forwards = 0  # forwards run with the predictor asleep, in all
        self.probe_forwards = 0  # forwards run with the predictions in the shadow only (probes), in all
        self.lost_windows = 0  # times predictions were paused
        self.excess = 0.0  # experts the live cache loaded beyond LRU's misses (moving sum)
        self.excess_seconds = 0.0  # predicting plus the excess demand loads at the wait per miss (moving sum)
        self.lru_misses = 0.0  # LRU's misses (moving sum)
        self.cost_seconds = 0.0  # the same, over COST_WINDOW (moving sum)
        self.forward_seconds = 0.0  # the forwards' own time (moving sum over COST_WINDOW)
        self._last_time = clock()
        self._acted = 0  # forwards since acting resumed
        self._missed_asleep = 0  # experts the live cache missed since the predictor fell asleep
        self._sleep_length = 0  # misses the present sleep lasts
        self._next_sleep = PROBE_AFTER  # the next sleep's: doubled by each loss, reset by a long win
        self._probe_start = (0, 0, 0.0)  # the twin's and LRU's misses, and seconds predicting, from the probe's second forward
        self._probe_left = 0  # forwards left in the probe
        self.lost_probes = 0  # probes after which the predictor slept again
        self._last = self._counts(spent())

    @property
    def shadowing(self) -> bool:
        """Whether a probe runs the predictions in the shadow now (the live cache goes on as LRU)."""
        return self.twin is not None

    def __contains__(self, key: Key) -> bool:
        return key in self.cache

    def on_forecast(self, chances: np.ndarray, layer: int | Sequence[int] | None = None) -> None:
        """The prefetcher's forecasts reach the live cache while acting, the twin while probing (a
        late table of a forward run before a pause reaches nothing)."""
        if self.acting:
            self.cache.on_forecast(chances, layer=layer)
        elif self.twin is not None:
            self.twin.on_forecast(chances, layer=layer)

    def prefetch(self, keys: list[Key] | None) -> None:
        """While probing: what the prefetcher would prefetch now goes into the twin (in time, as a
        probe asks whether acting could pay; acting is then judged on what it really costs)."""
        if self.twin is not None and keys:
            self.twin.prefetch_many(keys)

    def access(self, keys: list[Key]) -> None:
        """The live cache is accessed with `keys`: so are the shadows, unless the predictor sleeps (the
        live cache then runs as LRU, and the next probe copies it into the shadow)."""
        if not self.acting and self.twin is None:
            return
        self.lru.access_many(keys)
        if self.twin is not None:
            self.twin.access_many(keys)

    def shrink(self, capacity: int) -> None:
        """The live cache holds `capacity` keys from now on (the memory guard): so do the shadows."""
        self.lru.shrink(capacity)
        if self.twin is not None:
            self.twin.shrink(capacity)

    def on_forward(self) -> None:
        """A forward starts: weigh the last one's loads and time, and pause or resume predictions."""
        spent = self.spent()
        counts = self._counts(spent)
        live, lru, predicting, demand = (now - then for now, then in zip(counts, self._last))
        self._last = counts
        per_miss = spent.per_miss()  # an LRU miss would have cost as much as this run's
        net_seconds = predicting + (demand - lru) * per_miss
        now = self.clock()
        keep, keep_long = 1 - 1 / WINDOW, 1 - 1 / COST_WINDOW
        self.excess = keep * self.excess + live - lru
        self.lru_misses = keep * self.lru_misses + lru
        self.excess_seconds = keep * self.excess_seconds + net_seconds
        self.cost_seconds = keep_long * self.cost_seconds + net_seconds
        self.forward_seconds = keep_long * self.forward_seconds + now - self._last_time
        self._last_time = now
        if not self.acting:
            self._paused_forward(live)
            return
        self._acted += 1
        if self._acted == WARMUP:  # counted from here: the prefill's (or the catch-up's) loads and time are not
            self._forget()  # the decode's (a prompt's table prefetches dozens of experts)
        if self._acted == 2 * WINDOW:  # a probe that held: the next loss sleeps the first length again
            self._next_sleep = PROBE_AFTER
        slack = SLACK + SLACK_SHARE * self.lru_misses
        losing = self.excess > slack or self.excess_seconds > slack * per_miss
        costly = self._acted > WARMUP + WINDOW and self.cost_seconds > COST_SHARE * self.forward_seconds
        if self._acted > WARMUP and (losing or costly):
            self._pause()

    def start_sequence(self) -> None:
        """A new sequence starts (a batch-1 prompt): judge the predictor afresh, acting from its first
        forward, whatever it did for the last sequence (how much prediction pays is a prompt's: on
        runs/tb at 0.66 GB from 0.96x to 1.8x, results/bench-prediction-tb-0.66-asleep-free.json; a
        server's sleep carried over from the last request kept a prompt whose forecasts pay from them)."""
        self._shadow_live_cache()
        self._act()
        self._next_sleep = PROBE_AFTER
        self._last_time = self.clock()
        self.sleep(False)

    def _paused_forward(self, missed: int) -> None:
        """A forward while not acting, after the live cache `missed` experts in the last: asleep, or
        probing in the shadow; a probe starts when a sleep ends, acts as soon as it has won, and sleeps
        longer if its window runs out first."""
        if self.twin is not None:
            self._probe_left -= 1
            if self._probe_left == SHADOW_WINDOW:
                # the probe's first forward woke the predictor, which stepped its state over the tokens kept
                # while asleep: spent whatever the probe finds, so the probe is judged from its second forward
                self._probe_start = (self.twin.stats.misses, self.lru.stats.misses, self.spent().predictor_seconds)
            elif self._probe_left < SHADOW_WINDOW and self._probe_pays():
                self._act()  # a probe that has won already acts at once: each forward more runs LRU where it pays
                return
            if self._probe_left == 0:
                self._lose_probe()
        else:
            self._missed_asleep += missed
            if self._missed_asleep >= self._sleep_length:
                self._start_probe()
        if self.twin is None:
            self.paused_forwards += 1
        else:
            self.probe_forwards += 1

    def _start_probe(self) -> None:
        """The predictor wakes; the LRU shadow restarts as a copy of the live cache (which ran as LRU
        while the predictor slept: its learned ranks cleared), and the predictions go to a twin of it
        (its experts, in its order, under the live policy) for at most `SHADOW_WINDOW` forwards."""
        self._shadow_live_cache()
        self.twin = self._copy(self.lru, self.twin_policy())
        self._probe_left = SHADOW_WINDOW + 1  # the first forward wakes the predictor; judged from the next
        self.sleep(False)

    def _shadow_live_cache(self) -> None:
        """The LRU shadow restarts as a copy of the live cache; its misses count from here."""
        self.lru = self._copy(self.cache, make_policy("lru"))
        self._last = self._counts(self.spent())

    def _copy(self, cache: ExpertCache, policy: EvictionPolicy) -> ExpertCache:
        """A cache of `cache`'s capacity under `policy`, holding its experts accessed in its eviction
        order (least recent first under LRU): bookkeeping only."""
        copy = ExpertCache(cache.capacity, policy, n_layers=self.n_layers, top_k=self.top_k, n_experts=self.n_experts)
        for key in cache.eviction_order():
            copy.access(key)
        return copy

    def _probe_pays(self) -> bool:
        """Whether the probe's twin has missed `SHADOW_GAIN` fewer experts than the LRU shadow so far
        (from its second forward), and those misses, at this run's wait per miss, outweigh the time
        the probe spent predicting."""
        twin_misses, lru_misses, predicting = self._probe_start
        spent = self.spent()
        saved = (self.lru.stats.misses - lru_misses) - (self.twin.stats.misses - twin_misses)
        return saved >= SHADOW_GAIN and saved * spent.per_miss() > spent.predictor_seconds - predicting

    def _act(self) -> None:
        """Act on the predictions from this forward on (a probe won, a sequence starts), judged afresh."""
        self.twin, self.acting, self._acted = None, True, 0
        self._forget()

    def _lose_probe(self) -> None:
        """A probe's window ran without paying: sleep twice as long as before."""
        self.twin = None
        self.lost_probes += 1
        self._fall_asleep()

    def _fall_asleep(self) -> None:
        """The predictor sleeps until the next probe, each sleep twice the last."""
        self._missed_asleep, self._sleep_length = 0, self._next_sleep
        self._next_sleep *= 2
        self.sleep(True)

    def _forget(self) -> None:
        """Judge afresh from here: the sums of what acting cost start over."""
        self.excess = self.excess_seconds = self.cost_seconds = self.forward_seconds = 0.0

    def _pause(self) -> None:
        self.lost_windows += 1
        if self.lost_windows == 1:
            log.info("prediction guard: over the last %d tokens acting on the predictor loaded %+.0f experts and "
                     "spent %+.0f ms against LRU (net, %+.1f%% of the time); predictions paused, probed again "
                     "once the cache has missed %d experts", WINDOW, self.excess, self.excess_seconds * 1e3,
                     100 * self.cost_seconds / max(self.forward_seconds, 1e-9), self._next_sleep)
        self.acting = False
        self.paused_forwards += 1  # this forward runs paused
        self.cache.on_forecast(np.zeros((self.n_layers, self.n_experts)))  # learned ranks cleared: LRU
        self._fall_asleep()

    def _counts(self, spent: Spent) -> tuple[int, int, float, int]:
        """(experts the live cache inserted, LRU's misses, seconds predicting, demand loads) so far."""
        live = self.cache.stats
        return (live.misses + live.prefetch_inserts, self.lru.stats.misses, spent.predictor_seconds,
                spent.demand_loads)
