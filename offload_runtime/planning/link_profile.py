"""The slow tier's link as the runtime uses it: random reads of one expert's stored bytes, cold,
with 1, 2, 4, ... reads in flight.

A miss is one read of an expert (a few MB) at a random offset of a safetensors file, and the
runtime's transfer workers keep several in flight. Storage answers such reads faster with a
deeper queue, so `measure_random_reads` times them at each queue depth: `depth` threads issue
`os.preadv` at random expert-aligned offsets of a file, every page read dropped from the page cache
as the expert store drops it (`ExpertStore(drop_page_cache=True)`: read-ahead off, the whole file
dropped before each run, each read's pages after it). Depths are interleaved over the repeats and
every repeat is kept; the curve is the median per depth, and the depth the runtime should keep is
the smallest within 5% of the best median (`ReadCurve.depth`).
"""

from __future__ import annotations

import logging
import os
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from offload_runtime.engine.options import MAX_TRANSFER_WORKERS
from offload_runtime.engine.store import drop_pages
from offload_runtime.planning.hardware import load_profile
from offload_runtime.planning.hrm import ModelSpec
from offload_runtime.planning.read_curve import LinkProfileError, ReadCurve, chosen_depth
from prescient.model_dir import weight_files

log = logging.getLogger(__name__)

DEPTHS = (1, 2, 4, 8, 16)
DEFAULT_EXPERT_BYTES = 2 * 2**20  # without a model: about the bench model's int4 expert (2.3 MB)


def check_depths(depths: Sequence[int]) -> tuple[int, ...]:
    """Queue depths in 1..MAX_TRANSFER_WORKERS (as many as the runtime can keep in flight)."""
    for depth in depths:
        if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= MAX_TRANSFER_WORKERS:
            raise LinkProfileError(f"queue depth {depth!r} is out of range: give depths in 1..{MAX_TRANSFER_WORKERS}")
    return tuple(depths)


def profiled_depth(profile_path: str | Path | None) -> int:
    """The queue depth a `prescient profile-hw` JSON chose from its random-read curve."""
    if profile_path is None:
        raise LinkProfileError("--transfer-workers auto takes the queue depth from a hardware profile: give "
                               "--link-profile PROFILE.json (written by `prescient profile-hw --model DIR --json PATH`)")
    curve = load_profile(profile_path).random_reads
    if curve is None:
        raise LinkProfileError(f"hardware profile {profile_path} has no random-read curve; measure one with "
                               "`prescient profile-hw --model DIR --json PATH`")
    log.info("%d transfer workers: the queue depth %s chose", curve.depth, profile_path)
    return curve.depth


def model_read_file(model_dir: str | Path) -> tuple[Path, int]:
    """A model's largest safetensors file and one expert's stored bytes (`ModelSpec.expert_bytes`:
    compressed bytes for a compressed checkpoint)."""
    files = weight_files(Path(model_dir))
    if not files:
        raise LinkProfileError(f"{model_dir} holds no safetensors file to read experts from")
    return max(files, key=lambda p: p.stat().st_size), ModelSpec.from_config(model_dir).expert_bytes


def measure_random_reads(path: str | Path | None = None, expert_bytes: int = DEFAULT_EXPERT_BYTES, *,
                         depths: Sequence[int] = DEPTHS, repeats: int = 3, reads: int = 48,
                         directory: str | Path | None = None, file_bytes: int = 256 * 2**20,
                         seed: int = 0) -> ReadCurve:
    """Time `reads` cold random reads of `expert_bytes` at each depth, `repeats` times
    (interleaved: every depth once per repeat, the order rotated). `path`: the file to read (a
    model's safetensors); None: a `file_bytes` temporary file of random data in `directory`."""
    depths = check_depths(depths)
    if expert_bytes < 1 or repeats < 1 or reads < 1:
        raise LinkProfileError(f"expert_bytes, repeats and reads must be at least 1, got {expert_bytes}, {repeats}, "
                               f"{reads}")
    if path is None:
        with tempfile.TemporaryDirectory(prefix=".prescient-read-probe-", dir=directory) as tmp:
            probe = Path(tmp) / "probe.bin"
            _write_random(probe, max(file_bytes, 4 * expert_bytes))
            return measure_random_reads(probe, expert_bytes, depths=depths, repeats=repeats, reads=reads, seed=seed)
    path = Path(path)
    slots = path.stat().st_size // expert_bytes
    if slots < 2:
        raise LinkProfileError(f"{path} ({path.stat().st_size} bytes) holds fewer than two reads of {expert_bytes} bytes")
    rng = random.Random(seed)
    measured: dict[int, list[float]] = {d: [] for d in depths}
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead, as the expert store reads
        for r in range(repeats):
            for d in depths[r % len(depths):] + depths[:r % len(depths)]:
                offsets = [rng.randrange(slots) * expert_bytes for _ in range(reads)]
                measured[d].append(_timed_reads(fd, offsets, expert_bytes, d))
                log.info("depth %d: %.2f GB/s", d, measured[d][-1] / 1e9)
    finally:
        os.close(fd)
    rates = tuple(statistics.median(measured[d]) for d in depths)
    return ReadCurve(expert_bytes, depths, rates, tuple(tuple(measured[d]) for d in depths),
                     chosen_depth(depths, rates), str(path))


def _timed_reads(fd: int, offsets: list[int], nbytes: int, depth: int) -> float:
    """Bytes/s of reading `nbytes` at each offset, `depth` threads taking the next offset as each
    finishes, the file's pages dropped before and each read's pages after it."""
    drop_pages(fd)
    pending = iter(offsets)
    lock = threading.Lock()
    failures: list[OSError] = []

    def worker() -> None:
        buffer = memoryview(bytearray(nbytes))
        while True:
            with lock:
                offset = next(pending, None)
            if offset is None:
                return
            try:
                done = 0
                while done < nbytes:
                    got = os.preadv(fd, [buffer[done:]], offset + done)
                    if got == 0:
                        raise OSError(f"the file ends before byte {offset + nbytes}")
                    done += got
                drop_pages(fd, offset, nbytes)
            except OSError as exc:
                failures.append(exc)
                return

    threads = [threading.Thread(target=worker, name=f"read-probe-{i}") for i in range(depth)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - start
    if failures:
        raise LinkProfileError(f"reading the probe file failed ({failures[0]})")
    return len(offsets) * nbytes / seconds


def _write_random(path: Path, nbytes: int) -> None:
    chunk = os.urandom(16 * 2**20)
    with open(path, "wb", buffering=0) as f:
        written = 0
        while written < nbytes:
            written += f.write(chunk[: nbytes - written])
        os.fsync(f.fileno())
