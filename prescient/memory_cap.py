"""What a memory cap counts, and how it is held: the cgroup this process runs in, its own footprint.

A machine's memory limit counts the whole process: anonymous memory (weights, slots, KV cache),
the libraries it maps, and the page cache its reads leave behind. Where the process runs in a
cgroup with a memory limit (a container, a systemd slice, `bench --memory`'s runs), the kernel
holds that limit itself and reclaims page cache before it kills; elsewhere only the process can
hold it, by dropping the pages it reads (`ExpertStore(drop_page_cache=True)`).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import psutil

UNLIMITED = 2**60  # cgroup v1 writes "no limit" as a huge page-rounded number


def _cgroup_paths() -> list[Path]:
    """The memory-controller folders of this process's cgroup and of its parents, innermost first."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):  # cgroup v1's memory hierarchy
            root = Path("/sys/fs/cgroup/memory")
            break
    else:
        v2 = [line for line in lines if line.startswith("0::")]
        if not v2:
            return []
        root, path = Path("/sys/fs/cgroup"), v2[0].split(":", 2)[2]
    here = root / path.strip("/")
    return [here, *[parent for parent in here.parents if parent.is_relative_to(root)]]


def cgroup_limit() -> int | None:
    """The tightest memory limit over this process's cgroup and its parents, in bytes; None where
    there is none (or no cgroup can be read)."""
    limits = []
    for folder in _cgroup_paths():
        for name in ("memory.max", "memory.limit_in_bytes"):
            try:
                text = (folder / name).read_text().strip()
            except OSError:
                continue
            if text != "max" and int(text) < UNLIMITED:
                limits.append(int(text))
    return min(limits) if limits else None


# the file-backed pages a process under a cap must keep: the libraries' code and data every decoded
# token runs (17-22 MiB on runs/tb, results/code-pages-tb.json), and where experts are read through the
# page cache, room beside them for the kernel's file LRU, which ages active pages against the reads' pages:
# with 48 MiB booked in all, 2 of 4 runs at 0.66 GB on runs/tb re-read their code (18 major faults per
# token) or were killed; the rest of the ~127 MiB torch and transformers map is clean page cache the
# kernel reclaims under a cap
CODE_BYTES = 32 * 2**20
READ_HEADROOM_BYTES = 64 * 2**20
HOT_LIBRARY_BYTES = CODE_BYTES + READ_HEADROOM_BYTES


def release_free_memory() -> None:
    """Hand the pages the C allocator holds free back to the kernel (glibc's `malloc_trim`; a no-op
    elsewhere): loading leaves tens of MiB freed but still resident (45 MiB after loading runs/tw's
    non-expert weights and predictor, which cost one expert slot at 1.1 GB in some runs and not in others)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def anonymous_bytes() -> int:
    """This process's resident anonymous memory now (what only swap could take back), in bytes."""
    memory = psutil.Process(os.getpid()).memory_info()
    return memory.rss - getattr(memory, "shared", 0)  # Linux: `shared` is the file-backed resident pages


def file_backed_bytes() -> int:
    """This process's resident file-backed pages now (`RssFile`: the libraries it imported and has
    touched, the files it maps), in bytes; 0 where /proc cannot tell."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024  # kB
    return 0


def process_footprint(reads: bool = True) -> int:
    """What a cap must leave this process: its anonymous memory (which only swap could take back),
    measured after the allocator's free pages are handed back, and file pages for the library code
    it runs, whatever is mapped now: `HOT_LIBRARY_BYTES` where it reads experts through the page
    cache (`reads`), `CODE_BYTES` where it does not (the whole model in memory)."""
    release_free_memory()
    return anonymous_bytes() + (HOT_LIBRARY_BYTES if reads else CODE_BYTES)


def drop_file_pages(path: str | os.PathLike) -> None:
    """Drop the page cache of file `path` (what reading it left behind); a no-op where the system
    cannot."""
    if not hasattr(os, "posix_fadvise"):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
