"""Expert reads that pass around the page cache (`O_DIRECT`), straight into a slot.

Under `--memory` an expert read must not push the process's own pages (its libraries' code) out of
the page cache, and it should cost the CPU as little as possible: the two cores that read also
decode. A buffered `pread` copies every byte from the page cache into the slot and then drops the
pages again; `O_DIRECT` lets the device write into the slot itself. On this project's machine, a
cold read of one 34 MB expert of runs/tw, one read in flight: 0.99 GB/s and 15.0 ms of CPU buffered,
1.71 GB/s and 2.2 ms direct (`python -m experiments.read_path`, results/read-path-tw.json).

`O_DIRECT` needs the file offset, the memory address and the length aligned to the device's block
(`ALIGN`, 4096 bytes, a multiple of every common logical block size). A safetensors tensor starts at
any offset, so a piece can be read directly only into memory whose address has the same remainder
modulo `ALIGN` as its file offset: the slot pool allocates each parameter's buffers at that
remainder (`phased_empty`, the phase the store names in `ExpertStore.read_phases`). The aligned
middle of a piece is then read into place; its unaligned ends (under a block each) go through a
small aligned bounce block. A piece at another phase (runs/tb's four layers lie at four) is read
around the page cache all the same, into the reading thread's bounce buffer (`bounce_size`), and
copied out: 1.08 GB/s and 3.9 ms of CPU for that expert. A file system without `O_DIRECT` (tmpfs)
reads buffered, as before.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import torch

ALIGN = 4096
BOUNCE_BYTES = 4 << 20  # per reading thread, where a slot does not lie at its file's phase (at most)


def open_direct(path: Path) -> int | None:
    """A descriptor of `path` that reads around the page cache, or None where the system or the
    file system has none (the caller reads buffered)."""
    flag = getattr(os, "O_DIRECT", None)
    if flag is None:
        return None
    try:
        return os.open(path, os.O_RDONLY | flag)
    except OSError:  # EINVAL: the file system does not do direct I/O
        return None


def opens_direct(paths) -> bool:
    """Whether every file of `paths` can be read with `O_DIRECT`."""
    fds = [open_direct(path) for path in paths]
    for fd in fds:
        if fd is not None:
            os.close(fd)
    return bool(fds) and None not in fds


def phase_of(file_offset: int, memory_offset: int) -> int:
    """The address remainder (mod `ALIGN`) at which memory `memory_offset` bytes into a buffer must
    lie for bytes at `file_offset` to be read into it directly."""
    return (file_offset - memory_offset) % ALIGN


def phased_empty(shape: tuple[int, ...], dtype: torch.dtype, phase: int) -> torch.Tensor:
    """An uninitialised CPU tensor whose first byte's address is `phase` modulo `ALIGN` (a view
    into a buffer one block larger)."""
    nbytes = max(1, torch.Size(shape).numel()) * dtype.itemsize
    if phase % dtype.itemsize:  # no view of that dtype can start there
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    shift = (phase - raw.data_ptr()) % ALIGN
    return raw[shift:shift + nbytes].view(dtype)[: torch.Size(shape).numel()].view(shape)


def bounce_size(expert_bytes: int) -> int:
    """One reading thread's bounce buffer: `BOUNCE_BYTES`, or half an expert where that is less (two
    threads' buffers then hold no more than the expert in flight a buffered read books), whole blocks."""
    return max(ALIGN, min(BOUNCE_BYTES, expert_bytes // 2 // ALIGN * ALIGN))


def can_read_direct(address: int, file_offset: int) -> bool:
    """Whether memory at `address` can take the file's bytes from `file_offset` directly."""
    return (address - file_offset) % ALIGN == 0


def read_edges(fd: int, memory: memoryview, offset: int) -> tuple[int, int]:
    """Fill the unaligned ends of `memory` (the file's bytes from `offset` on, at the file's phase)
    through a bounce block; returns the aligned middle [start, end) of `memory` still to read
    directly (empty where the whole piece lay in its end blocks)."""
    end = offset + len(memory)
    middle_start = min(-(-offset // ALIGN) * ALIGN, end)
    middle_end = max(end // ALIGN * ALIGN, middle_start)
    with mmap.mmap(-1, ALIGN) as block:  # page-aligned, as O_DIRECT wants
        bounce = memoryview(block)
        if middle_start > offset:
            read_bounced(fd, memory[: middle_start - offset], offset, bounce)
        if end > middle_end:
            read_bounced(fd, memory[middle_end - offset:], middle_end, bounce)
        bounce.release()
    return middle_start - offset, middle_end - offset


def read_bounced(fd: int, memory: memoryview, offset: int, bounce: memoryview) -> None:
    """Fill `memory` with the file's bytes from `offset` on, at any address: the whole blocks that
    cover them are read directly into `bounce` (aligned, a multiple of `ALIGN` long), span by span,
    and each span's bytes copied out."""
    end = offset + len(memory)
    block = offset // ALIGN * ALIGN
    while block < end:
        got = 0
        while got < len(bounce):  # a direct read returns less only at the end of the file
            read = os.preadv(fd, [bounce[got:]], block + got)
            if read == 0:
                break
            got += read
        first, last = max(offset, block), min(end, block + len(bounce))
        if block + got < last:
            raise OSError(f"the file ends at byte {block + got}, before byte {last}")
        memory[first - offset:last - offset] = bounce[first - block:last - block]
        block += len(bounce)
