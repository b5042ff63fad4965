"""The machine a benchmark ran on, for its JSON."""

from __future__ import annotations

import ctypes
import gc
import os
import platform
from typing import Any

import torch


def machine_info(threads: int) -> dict[str, Any]:
    """CPUs, memory, load and library versions; `threads`: the torch threads a run uses."""
    import accelerate
    import psutil
    import transformers

    return {"cpu_count": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)), "torch_threads": threads,
            "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "load_average_at_start": [round(x, 2) for x in os.getloadavg()], "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__, "accelerate": accelerate.__version__}


def release_freed_memory() -> None:
    """Free what the last run dropped and hand freed heap memory back to the OS (glibc
    `malloc_trim`), so that RSS shows live memory. A model and its offload runtime refer to each
    other, so a finished run's slot pool is freed only by the cycle collector: without this, runs
    in one process pile their slot pools up until it happens to run."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
