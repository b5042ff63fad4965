"""Bytes a process has had read from storage (Linux's /proc/<pid>/io), with nothing of torch:
the llama.cpp system of `bench --memory` reads its process's from a child that must hold no more
than llama.cpp does under the same memory cap."""

from __future__ import annotations


def storage_reads(pid: int | str = "self") -> int | None:
    """Bytes process `pid` (this one by default) has had read from storage so far, by its reads,
    faults and read-ahead alike (Linux's /proc/<pid>/io `read_bytes`); None where the system does
    not count them or the process is not readable."""
    try:
        with open(f"/proc/{pid}/io", "rb") as io:
            for line in io:
                if line.startswith(b"read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None
