"""Cold reads of one expert's bytes as the expert store reads a miss: through the page cache (its
pages dropped after, `ExpertStore(drop_page_cache=True)`'s buffered path) or around it (`O_DIRECT`,
`offload_runtime.engine.direct_read`): straight into memory at the file's phase (`direct`), or,
into memory at another phase, through a bounce buffer of `bounce_size` (`bounced`); each split into
1, 2, 4 or 8 reads in flight; wall time and the CPU time the reading threads spent.

    python -m experiments.read_path --file runs/tw/model.safetensors --mib 34 --reads 8 --json out.json

Reads go to random block-aligned offsets of the file; the kinds and depths are interleaved within
each repeat.
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from offload_runtime.engine.direct_read import ALIGN, bounce_size, open_direct, read_bounced
from prescient.atomic import write_results

DEPTHS = (1, 2, 4, 8)
_BOUNCES = threading.local()


def _read_fully(fd: int, memory: memoryview, offset: int) -> None:
    done = 0
    while done < len(memory):
        done += os.preadv(fd, [memory[done:]], offset + done)


def _read(fd: int, memory: memoryview, offset: int, pool: ThreadPoolExecutor | None, depth: int,
          bounced: bool) -> None:
    def read(part: memoryview, at: int) -> None:
        if not bounced:
            _read_fully(fd, part, at)
            return
        if not hasattr(_BOUNCES, "buffer"):  # one per thread, kept, as the expert store keeps it
            _BOUNCES.buffer = memoryview(mmap.mmap(-1, bounce_size(len(memory))))
        read_bounced(fd, part, at, _BOUNCES.buffer)

    if pool is None:
        read(memory, offset)
        return
    chunk = -(-len(memory) // depth // ALIGN) * ALIGN
    list(pool.map(lambda start: read(memory[start:start + chunk], offset + start), range(0, len(memory), chunk)))


def measure(path: Path, size: int, reads: int, seed: int = 0) -> dict:
    buffered = os.open(path, os.O_RDONLY)
    direct = open_direct(path)
    if direct is None:
        raise SystemExit(f"{path}: its file system reads nothing with O_DIRECT")
    length = os.fstat(buffered).st_size
    os.posix_fadvise(buffered, 0, 0, os.POSIX_FADV_RANDOM)
    os.posix_fadvise(buffered, 0, 0, os.POSIX_FADV_DONTNEED)
    buffer = mmap.mmap(-1, size + ALIGN)  # page-aligned: every kind reads into the same memory
    memory, shifted = memoryview(buffer)[:size], memoryview(buffer)[100:100 + size]  # shifted: another phase
    pools = {depth: ThreadPoolExecutor(depth) for depth in DEPTHS if depth > 1}
    rng, runs = random.Random(seed), []
    for repeat in range(reads):
        for kind, fd in (("buffered", buffered), ("direct", direct), ("bounced", direct)):
            for depth in DEPTHS:
                offset = rng.randrange(0, length - size) // ALIGN * ALIGN
                wall, cpu = time.perf_counter(), time.process_time()
                _read(fd, shifted if kind == "bounced" else memory, offset, pools.get(depth), depth, kind == "bounced")
                if kind == "buffered":
                    os.posix_fadvise(buffered, offset, size, os.POSIX_FADV_DONTNEED)
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                runs.append({"kind": kind, "depth": depth, "repeat": repeat, "offset": offset,
                             "GB_per_s": size / wall / 1e9, "cpu_ms": cpu * 1e3, "wall_ms": wall * 1e3})
    for fd in (buffered, direct):
        os.close(fd)
    summary = []
    for kind in ("buffered", "direct", "bounced"):
        for depth in DEPTHS:
            mine = [r for r in runs if r["kind"] == kind and r["depth"] == depth]
            rates, cpus = [r["GB_per_s"] for r in mine], [r["cpu_ms"] for r in mine]
            summary.append({"kind": kind, "depth": depth, "GB_per_s": {"median": statistics.median(rates),
                            "min": min(rates), "max": max(rates)}, "cpu_ms": {"median": statistics.median(cpus),
                            "min": min(cpus), "max": max(cpus)}})
    return {"what": "cold reads of one expert's bytes, buffered (pages dropped after), O_DIRECT in place and "
                    "O_DIRECT through a bounce buffer",
            "file": str(path), "read_bytes": size, "reads_per_cell": reads, "load_average_at_start": os.getloadavg(),
            "cpu_count": os.cpu_count(), "summary": summary, "runs": runs}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--file", type=Path, required=True, help="a large file, e.g. a model's safetensors")
    parser.add_argument("--mib", type=float, required=True, help="bytes of one read (one expert), in MiB")
    parser.add_argument("--reads", type=int, default=8, help="reads per kind and depth")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    record = measure(args.file, int(args.mib * 2**20) // ALIGN * ALIGN, args.reads)
    record["command"] = "python -m experiments.read_path " + " ".join(argv if argv is not None else sys.argv[1:])
    write_results(record, args.json)
    for row in record["summary"]:
        print(f"{row['kind']:8} depth {row['depth']}: {row['GB_per_s']['median']:.2f} GB/s, "
              f"{row['cpu_ms']['median']:.1f} ms of CPU a read")


if __name__ == "__main__":
    main()
