"""The torch threads a decode runs with when the user names none (a user never sets
`OMP_NUM_THREADS`): every CPU this process may run on, but no more than its cgroup's CPU quota
grants (a container given 2 CPUs of a 64-core host must not start 64 threads, as OpenMP's default
would).

Measured with the default expert kernel ("gemv"), 96 greedy tokens, interleaved repeats, on this
project's 2-core machine: runs/tw 170.9 tok/s at 2 threads (164.3-173.5) against 108.7 at 1
(102.3-109.4), results/bench-decode-tw-rowdot.json: the second core's gain is beyond either's spread.
`generate` and `serve` set it unless told, and `bench --memory` runs its systems with it.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "QUOTA PERIOD" or "max PERIOD"


def cpu_quota(path: Path = CPU_MAX) -> int | None:
    """The CPUs this cgroup's quota grants (rounded up), None where it sets none or is unreadable."""
    try:
        quota, period = path.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return max(1, math.ceil(int(quota) / int(period)))
    except (ValueError, ZeroDivisionError):
        return None


def decode_threads() -> int:
    """The CPUs this process may run on (its affinity), capped by its cgroup's CPU quota."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cpu_quota()
    return max(1, min(usable, quota) if quota else usable)


def use_decode_threads(threads: int | None = None) -> int:
    """Set torch's threads to `threads`, or to `decode_threads()` where None; the count set."""
    import torch

    count = threads or decode_threads()
    torch.set_num_threads(count)
    return count
