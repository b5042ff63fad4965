"""The memory guard: a decode under `--memory` that thrashes gives expert slots back until it stops.

Under a cap, memory the process did not plan for (an allocator arena, a library's buffers) is
anonymous and cannot be reclaimed, so the kernel takes back the file-backed pages instead: the
libraries' code that every token runs. The process then reads its own code from disk at every
token, and its speed falls by orders of magnitude without any error. The symptom is cheap to
watch: major page faults per token (`getrusage`). When they exceed `FAULTS_PER_TOKEN` over a
window of `WINDOW` forwards (after the first window: a process faults its code paths in once, at
the prefill and first tokens; on runs/tb at 0.66 GB that alone gave back a slot in every run), the guard has the runtime give back `SHARE` of its slots (evicted
now, their pages handed back to the kernel), then watches a new window; it never goes below one
layer's top-k. It says so once in the log; the runtime's statistics count the slots given back.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

try:
    import resource
except ImportError:  # not a Unix: no fault counts, no guard
    resource = None

log = logging.getLogger(__name__)

WINDOW = 8  # forwards over which major faults are counted
FAULTS_PER_TOKEN = 1.0  # above this over a window the process is re-reading its own pages
SHARE = 0.1  # of the slots given back at each trip


def major_faults() -> int:
    """This process's major page faults so far (0 where the system does not count them)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_majflt if resource is not None else 0


class MemoryGuard:
    """Watches major faults per forward (`check`, at each forward's start) and calls
    `give_back(count)` (slots to give back; returns the bytes freed) when they climb, while more
    than `least` slots are left of `slots`."""

    def __init__(self, give_back: Callable[[int], int], slots: int, least: int) -> None:
        self.give_back = give_back
        self.slots, self.least = slots, least
        self.given_back = 0  # slots
        self.trips = 0
        self._faults: deque[int] = deque(maxlen=WINDOW + 1)
        self._cold = WINDOW  # forwards not judged: the prefill and first tokens fault code in once

    def check(self) -> None:
        if self._cold:
            self._cold -= 1
            return
        self._faults.append(major_faults())
        if len(self._faults) <= WINDOW or self.slots <= self.least:
            return
        per_forward = (self._faults[-1] - self._faults[0]) / WINDOW
        if per_forward <= FAULTS_PER_TOKEN:
            return
        count = min(max(1, int(SHARE * self.slots)), self.slots - self.least)
        freed = self.give_back(count)
        self.slots -= count
        self.given_back += count
        self.trips += 1
        if self.trips == 1:
            log.warning("memory guard: %.0f major page faults per token over %d tokens (the process re-reads its "
                        "own pages from disk: it holds more than its memory plan counted); gave back %d expert "
                        "slots (%.0f MiB), %d left; it gives more back while faults stay above %g per token",
                        per_forward, WINDOW, count, freed / 2**20, self.slots, FAULTS_PER_TOKEN)
        self._faults.clear()
