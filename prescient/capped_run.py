"""Run one command under a memory cap: a memory cgroup made for that run alone (cgroup v1 or v2),
its peak, and whether the kernel killed it for want of memory. With no writable cgroup the run
goes uncapped and its record says so. `bench --memory` runs each system so, and `tune` each decode.

    outcome = run_capped([sys.executable, "-m", "some.child", spec, out], 2**30)
    outcome.killed, outcome.peak_bytes
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

CGROUP_ROOT = Path("/sys/fs/cgroup")
HOW_COUNTED = {
    "v1": "cgroup v1 memory controller: memory.limit_in_bytes caps, memory.max_usage_in_bytes is the peak; it "
          "charges anonymous memory and the page cache the run's reads and mappings bring in (libraries, the "
          "checkpoint), as a real machine's memory holds both; clean page cache is reclaimed before the kernel "
          "kills; no swap",
    "v2": "cgroup v2: memory.max caps, memory.peak is the peak; it charges anonymous memory and the page cache the "
          "run's reads and mappings bring in, as a real machine's memory holds both; clean page cache is reclaimed "
          "before the kernel kills",
    "none": "no writable memory cgroup: the run is NOT capped; the peak is the child's own peak RSS (VmHWM), "
            "without the page cache",
}


@dataclass
class CappedRun:
    """How one capped command ended: `returncode` (negative: the signal; None: timed out),
    `killed` (by the kernel for want of memory under the cap), `peak_bytes` (the cgroup's peak;
    None without one), `capped` (a cgroup held the cap), `cgroup` ("v1", "v2" or "none"),
    `oom_kills` and `limit_hits` (the controller's counters, where it keeps them), `seconds`, and
    the tail of the command's stderr."""

    returncode: int | None
    killed: bool
    timed_out: bool
    peak_bytes: int | None
    cap_bytes: int | None
    capped: bool
    cgroup: str
    oom_kills: int | None
    limit_hits: int | None
    seconds: float
    stderr_tail: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _counter(text: str | None, key: str) -> int | None:
    """`key N` from a flat-keyed cgroup file (memory.events, memory.oom_control)."""
    for line in (text or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return None


class _Group:
    """A memory cgroup made for one run; `version` "v1" or "v2"."""

    def __init__(self, path: Path, version: str) -> None:
        self.path, self.version = path, version

    def limit(self, cap_bytes: int | None) -> None:
        if cap_bytes is not None:
            name = "memory.limit_in_bytes" if self.version == "v1" else "memory.max"
            (self.path / name).write_text(str(cap_bytes))

    def join(self) -> None:
        """Move the calling process in (run in the child between fork and exec)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak(self) -> int | None:
        text = _read(self.path / ("memory.max_usage_in_bytes" if self.version == "v1" else "memory.peak"))
        return int(text) if text and text.strip().isdigit() else None

    def oom_kills(self) -> int | None:
        return _counter(_read(self.path / ("memory.oom_control" if self.version == "v1" else "memory.events")),
                        "oom_kill")

    def limit_hits(self) -> int | None:
        if self.version == "v1":
            text = _read(self.path / "memory.failcnt")
            return int(text) if text else None
        return _counter(_read(self.path / "memory.events"), "max")

    def remove(self) -> None:
        for _ in range(50):  # the last task may take a moment to leave after it is reaped
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup paths: {"memory": path} (v1) and/or {"": path} (v2)."""
    out = {}
    for line in (_read(Path("/proc/self/cgroup")) or "").splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            out[name] = path
    return out


def make_group(name: str) -> _Group | None:
    """A fresh memory cgroup `name` beside this process's own (or at the controller's root); None
    where none can be made (not root, no memory controller, v2 without memory delegated)."""
    own = _own_cgroups()
    if "memory" in own:
        parents, version = [CGROUP_ROOT / "memory" / own["memory"].lstrip("/"), CGROUP_ROOT / "memory"], "v1"
    elif "" in own and (CGROUP_ROOT / "cgroup.controllers").exists():
        parents, version = [CGROUP_ROOT / own[""].lstrip("/").rsplit("/", 1)[0], CGROUP_ROOT], "v2"
    else:
        return None
    for parent in parents:
        try:
            path = parent / name
            path.mkdir(exist_ok=True)
        except OSError:
            continue
        if version == "v2" and not (path / "memory.max").exists():
            try:
                (parent / "cgroup.subtree_control").write_text("+memory")
            except OSError:
                pass
        if (path / ("memory.limit_in_bytes" if version == "v1" else "memory.max")).exists():
            return _Group(path, version)
        path.rmdir()
    return None


def cgroup_kind() -> str:
    """"v1", "v2" or "none": what `run_capped` can cap with on this machine."""
    group = make_group(f"prescient-capped-probe-{os.getpid()}")
    if group is None:
        return "none"
    group.remove()
    return group.version


def drop_page_cache() -> bool:
    """Write dirty pages back and drop the clean page cache (root only); whether it was dropped."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1")
        return True
    except OSError:
        return False


def run_capped(argv: list[str], cap_bytes: int | None, timeout_s: float = 1800.0) -> CappedRun:
    """Run `argv` in a cgroup of its own capped at `cap_bytes` (None: uncapped, still measured);
    a run past `timeout_s` is killed and marked timed out. Whatever ends the wait early (SIGTERM's
    `StoppedBySignal`, Ctrl-C) kills the run's whole session and reaps it before it propagates, and
    the cgroup is removed on every way out."""
    group = make_group(f"prescient-capped-{os.getpid()}-{time.monotonic_ns()}")
    try:
        if group is not None:
            group.limit(cap_bytes)
        start = time.perf_counter()
        process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                   start_new_session=True, preexec_fn=group.join if group else None)
        timed_out = False
        try:
            _, stderr = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            _, stderr = process.communicate()
            timed_out = True
        except BaseException:
            _kill_and_reap(process)
            raise
        seconds = time.perf_counter() - start
        peak = oom = hits = None
        if group is not None:
            peak, oom, hits = group.peak(), group.oom_kills(), group.limit_hits()
    finally:
        if group is not None:
            group.remove()
    code = None if timed_out else process.returncode
    killed = not timed_out and group is not None and cap_bytes is not None and (
        bool(oom) or (oom is None and code == -signal.SIGKILL))
    return CappedRun(code, killed, timed_out, peak, cap_bytes, group is not None and cap_bytes is not None,
                     group.version if group else "none", oom, hits, round(seconds, 2), stderr[-2000:])


def _kill_and_reap(process: subprocess.Popen) -> None:
    """Kill `process`'s session (it leads one) and wait for it, with SIGINT and SIGTERM held back
    meanwhile so that a second signal cannot leave it running or unreaped."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:  # it had ended already
            pass
        process.wait()
        if process.stderr is not None:
            process.stderr.close()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
