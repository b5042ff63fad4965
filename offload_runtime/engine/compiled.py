"""The runtime's compiled kernels loaded into the process from numba's on-disk cache before a memory
plan measures it; where the cache lacks one, compiled first by a child process.

numba compiles a kernel at its first call and keeps the machine code on disk (`cache=True`: the
`__pycache__` beside its module); later processes load it from there. Compiling leaves LLVM's
memory in the process for good, so a plan that measured a process which had just compiled gave a
fresh checkout's first `--memory` run fewer slots than every later run at the same cap.
`load_compiled` calls the kernels a serving cache and SiDA's fused step run with numba told to
compile nothing; at the first kernel its cache lacks it stops, runs `compile_here` in child
processes (the same calls, with the expert kernel's `rowdot` product, each compiled and saved to the cache,
the compiler's memory ending with the child) and calls them again, loaded from the cache now. Where
numba cannot save (no writable cache folder) they compile here after all, said in the log.

A command under `--memory` refuses a cap too small before it compiles anything: compiling runs/tb's
kernels took 13.8 s of a fresh checkout's 20.4 s refusal (each child timed: the cache's 7.1, SiDA's
step 4.1, the row product 1.1, two lookups 1.5; results/refusal-tb-first-run-470.json), against the
5 s a refusal takes without, and the process cannot compile beside itself once it holds torch (about
400 MiB on runs/tb, of which torch and transformers are most): under a cap just above the refusal
the compiler children (70-125 MB each) found no room beside it (a fresh checkout's first run at 480
MiB never finished, results/refusal-tb-first-run-480.json). So the command, before it imports torch,
only notes that it may start again (`prepare_command`); the loader checks the plan first, and where
numba's cache then lacks what the run calls (its policy's cache kernels, SiDA's step with a SiDA
predictor, the row product), `load_compiled` starts the command again in the same process (`exec`),
naming those kernels (`COMPILE_FIRST`): small again, it compiles them in child processes, two at
once where the cap leaves room, and runs. A run whose every expert is resident calls no kernel and
compiles none. `compile_ahead` compiles every kernel a run may call (`AHEAD`) before torch for
`tune` and `bench`, whose runs start from their own processes; once its children have found them all
it keeps what they read in a stamp (`STAMP`: each file, with its time and size), and while the stamp
holds it spawns nothing. This module imports no torch (the kernels' modules that do are imported
where they are called) so that a command can call it that early.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import numba
import numpy as np
from numba.core import config, event
from numba.core.caching import NullCache
from numba.core.dispatcher import Dispatcher

from cache import make_serving_policy
from cache.expert_cache import load_kernels
from cache.policies import SERVING_POLICIES
from prescient.atomic import write_json_atomic
from prescient.errors import PrescientError
from prescient.memory_cap import cgroup_limit, process_footprint

log = logging.getLogger(__name__)

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder the child imports this code from
CHILD_TIMEOUT_S = 600.0
# what loading the kernels from numba's cache adds to a process beside torch (numba's runtime, their machine
# code), at least: the cache's 26.3-26.6 MiB whatever the policy, with SiDA's step 28.4-28.7 (`Kernels.loaded_bytes`)
LOADED_BYTES, STEP_BYTES = 26 * 2**20, 2 * 2**20
KERNEL_PACKAGES = ("cache", "predictor", "offload_runtime")  # the packages whose modules hold the kernels
STAMP = "runtime-kernels-found.json"  # `compile_ahead`'s, in numba's cache folder or this module's `__pycache__`
COMPILE_FIRST = "PRESCIENT_COMPILE_FIRST"  # in a command started again to compile: the kernels it compiles (JSON)
CHILD_BYTES = 128 * 2**20  # one compiling child's memory at most (70-125 MB on runs/tb's kernels)
_restart = {"allowed": False}  # `prepare_command`'s note: `load_compiled` may start the command again


@dataclass(frozen=True)
class Kernels:
    """Which kernels a run calls: the serving cache's with eviction `policy` (None: every serving
    policy's, where the policy is not resolved yet), and SiDA's fused decode step where a SiDA
    predictor runs (`predictor_step`). Their machine code is the same whatever the model's sizes:
    they are called on throwaway data of two of everything."""

    policy: str | None
    predictor_step: bool

    @property
    def loaded_bytes(self) -> int:
        """What loading these kernels adds to a process, at least (a plan may count it before they load)."""
        return LOADED_BYTES + (STEP_BYTES if self.predictor_step else 0)


# what `compile_ahead` compiles by default: whatever policy and predictor a run resolves later (with torch)
AHEAD = Kernels(None, predictor_step=True)


class CompileNeeded(Exception):
    """numba was about to compile a kernel that its on-disk cache lacks."""


class _CompileWatch(event.Listener):
    """Notices numba starting to compile on the thread that made it; `refuse`: stops that compile
    (`CompileNeeded`), else counts it."""

    def __init__(self, refuse: bool) -> None:
        self.refuse, self.thread, self.compiled = refuse, threading.get_ident(), []

    def on_start(self, event_: event.Event) -> None:
        dispatcher = event_.data["dispatcher"]
        if threading.get_ident() != self.thread or isinstance(dispatcher._cache, NullCache):
            return  # another thread's, or a function numba compiles in every process (no cache: counted alike)
        name = dispatcher.py_func.__qualname__
        if self.refuse:
            raise CompileNeeded(name)
        self.compiled.append(name)

    def on_end(self, event_: event.Event) -> None:
        pass


@contextmanager
def watching_compiles(refuse: bool) -> Iterator[_CompileWatch]:
    """numba's compiles on this thread while inside: refused (`CompileNeeded`), or counted."""
    watch = _CompileWatch(refuse)
    with event.install_listener("numba:compile", watch):
        yield watch


def load_compiled(kernels: Kernels) -> None:
    """Bring `kernels`' machine code into this process from numba's cache, compiling any it lacks
    in a child process first (see the module's doc)."""
    try:
        with watching_compiles(refuse=True):
            _call(kernels)
        return
    except CompileNeeded as missing:
        if _restart["allowed"]:
            _start_again_compiling(kernels, str(missing))
        log.info("numba's cache lacks %s: compiling the runtime's kernels in child processes", missing)
    compile_in_child(kernels)
    with watching_compiles(refuse=False) as watch:
        _call(kernels)
    if watch.compiled:
        log.warning("numba compiled %s in this process (its cache could not keep them): a memory plan counts "
                    "the compiler's memory as the process's", ", ".join(watch.compiled))


def restarts() -> bool:
    """Whether `load_compiled` starts the command again where numba's cache lacks a kernel (so the
    loader checks the plan before it loads them: see the module's doc)."""
    return _restart["allowed"]


def prepare_command(restartable: bool) -> None:
    """What a command under `--memory` runs before it imports torch (see the module's doc): in a
    command started again to compile (`COMPILE_FIRST`), the kernels it named compiled now; else,
    where the command can be started again as it was (`restartable`: this process runs it alone),
    `load_compiled` allowed to do so; else every kernel compiled ahead (`compile_ahead`)."""
    named = os.environ.pop(COMPILE_FIRST, None)
    if named is not None:
        compile_ahead(Kernels(**json.loads(named)))
    elif restartable:
        _restart["allowed"] = True
    else:
        compile_ahead()


def _start_again_compiling(kernels: Kernels, missing: str) -> None:
    """Replace this process by the command it runs, started again with `kernels` named to compile
    first (`prepare_command`): it never returns."""
    log.info("numba's cache lacks %s: starting the command again, to compile the kernels this run calls "
             "first while the process is small", missing)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.execve(sys.executable, sys.orig_argv, {**os.environ, COMPILE_FIRST: json.dumps(asdict(kernels))})


def compile_ahead(kernels: Kernels = AHEAD) -> None:
    """Put `kernels` (default: every kernel a run may load, `AHEAD`) and the row product in numba's
    cache where it lacks them, compiled by child processes, loading none into this process (see the
    module's doc): unless the stamp of an earlier call holds, the children load or compile each
    part, and where they found every part of `AHEAD` the files they read are kept in the stamp. A
    child that fails is logged and leaves its part to `load_compiled`."""
    if _stamp_holds():
        return
    files = compile_in_child(kernels)
    if kernels == AHEAD and files:
        stamp = _stamp(files)
        if None not in stamp["files"].values():  # a kernel numba did not save has no index file
            _keep_stamp(stamp)


def _stamp_path() -> Path:
    """Where `compile_ahead` keeps its stamp: numba's cache folder where one is set, else beside this module."""
    return Path(config.CACHE_DIR or Path(__file__).parent / "__pycache__") / STAMP


def _stamp(files) -> dict:
    """What kernels loaded from `files` depend on: numba, the python, each file's time and size."""
    stats = {}
    for path in sorted(files):
        try:
            stat = os.stat(path)
            stats[path] = [stat.st_mtime_ns, stat.st_size]
        except OSError:
            stats[path] = None
    return {"numba": numba.__version__, "python": sys.executable, "files": stats}


def _stamp_holds() -> bool:
    """Whether a stamp was kept and nothing it depends on changed since."""
    try:
        kept = json.loads(_stamp_path().read_text())
    except (OSError, ValueError):
        return False
    return isinstance(kept, dict) and bool(kept.get("files")) and kept == _stamp(kept["files"])


def _keep_stamp(stamp: dict) -> None:
    """Write `stamp` where `_stamp_holds` reads it."""
    try:
        write_json_atomic(_stamp_path(), stamp)
    except (OSError, PrescientError) as exc:  # a folder not writable: each `compile_ahead` then spawns its children
        log.debug("the kernels' stamp was not kept (%s)", exc)


# the child imports only the kernels' own modules: stand-ins for the packages whose `__init__` imports
# the whole runtime (transformers and all), and for torch, which the kernels' modules import but the
# child calls none of (147 MB of anonymous memory beside a process under a cap, for nothing)
CHILD = """
import json, sys, types
sys.path.insert(0, sys.argv[1])
sys.modules["torch"] = types.ModuleType("torch")
for name in ("offload_runtime", "offload_runtime.engine", "predictor"):
    package = types.ModuleType(name)
    package.__path__ = [sys.argv[1] + "/" + name.replace(".", "/")]
    sys.modules[name] = package
from offload_runtime.engine import compiled
compiled.compile_here(compiled.Kernels(**json.loads(sys.argv[2])), sys.argv[3])
"""


def _run_child(kernels: Kernels, part: str) -> str | None:
    """`compile_here` of `part` of `kernels` in a child process of the same python (`CHILD`); its
    output, or None where it failed (logged)."""
    what = f"compiling the kernels ({part})"
    argv = [sys.executable, "-c", CHILD, str(PACKAGE_ROOT), json.dumps(asdict(kernels)), part]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("%s in a child process failed (%s)", what, exc)
        return None
    if done.returncode != 0:
        log.warning("%s in a child process failed (exit %s): %s", what, done.returncode,
                    " ".join(done.stderr.strip().splitlines()[-1:]))
        return None
    return done.stdout


def compile_in_child(kernels: Kernels) -> set[str] | None:
    """Run `compile_here` in child processes of the same python, one per part of `kernels`
    (`_parts`), as many at once as `_at_once` allows, each loading or compiling and saving its part;
    the cache files they read (`_cache_files`), or None where one failed (logged: the kernels then
    compile here)."""
    parts = _parts(kernels)
    with ThreadPoolExecutor(_at_once(len(parts))) as pool:
        outputs = list(pool.map(lambda part: _run_child(kernels, part), parts))
    if None in outputs:
        return None
    return {file for output in outputs for file in json.loads(output.splitlines()[-1])}


def _at_once(parts: int) -> int:
    """How many compiling children run at once: one per CPU this process may use, as many as the
    cgroup's limit leaves room for beside this process (`CHILD_BYTES` each), at least one."""
    room = parts
    limit = cgroup_limit()
    if limit is not None:
        room = (limit - process_footprint(reads=False)) // CHILD_BYTES
    return max(1, min(parts, len(os.sched_getaffinity(0)), room))


def compile_here(kernels: Kernels, part: str) -> None:
    """A child's work: one part of `kernels` (`_parts`), compiled where numba's cache lacks it;
    prints (as JSON) the cache files it read (`_cache_files`)."""
    PARTS[part](kernels)
    print(json.dumps(sorted(_cache_files())))


def _cache_files() -> set[str]:
    """The source and cache index file of each function of the kernels' packages loaded in this
    process from numba's cache (what numba checks before it loads one)."""
    files = set()
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] not in KERNEL_PACKAGES:
            continue
        for value in vars(module).values():
            if isinstance(value, Dispatcher) and value.overloads and not isinstance(value._cache, NullCache):
                files.update((value._cache._cache_file._index_path, value.py_func.__code__.co_filename))
    return files


def _parts(kernels: Kernels) -> list[str]:
    """The parts `kernels` are compiled in (`PARTS`): the cache's, SiDA's step where it runs, the row product."""
    return ["cache", *(["predictor_step"] if kernels.predictor_step else []), "rowdot"]


def _call(kernels: Kernels) -> None:
    """Run each of `kernels` once on throwaway data."""
    _cache_kernels(kernels.policy)
    if kernels.predictor_step:
        _sida_step()


def _cache_kernels(policy: str | None) -> None:
    """The serving cache's kernels with eviction `policy` (None: each serving policy's), on two layers
    (`load_kernels`)."""
    for name in SERVING_POLICIES if policy is None else (policy,):
        load_kernels(make_serving_policy(name, 2), 2, 4, 2)


def _sida_step() -> None:
    """SiDA's fused decode step once, on weights of two of everything (the arrays' kinds, not their
    sizes, decide its machine code)."""
    from predictor import sida_decode  # imports torch (see the module's doc)

    two = np.zeros((2, 2), np.float32)
    weights = sida_decode.DecodeWeights(
        table=two, w_ih_first=np.zeros((8, 2), np.float32), w_ih_rest=np.zeros((1, 8, 2), np.float32),
        w_hh=np.zeros((2, 8, 2), np.float32), bias=np.zeros((2, 8), np.float32), query_key=two, scale=1.0,
        head_w=two, head_b=np.zeros(2, np.float32), forecast_w=two, forecast_b=np.zeros(2, np.float32))
    sida_decode.step_tokens(weights, sida_decode.DecodeState.start(1, 2, 2, 2), np.zeros(1, np.int64))


def _rowdot_products() -> None:
    """The expert kernel's row product on one thread and on two, as a decode runs it: the parent
    does not load it before its plan (the plan books its workspace), but from a cache without it
    the first decoded token would compile it inside the cap."""
    from offload_runtime.engine import rowdot  # imports torch (see the module's doc)

    weight, row, out = np.zeros((2, 2), np.float32), np.zeros(2, np.float32), np.zeros(2, np.float32)
    for threads in (1, 2):
        rowdot.rows_product(weight, row, out, threads)


# each part of the kernels a child loads or compiles (`compile_here`)
PARTS = {"cache": lambda kernels: _cache_kernels(kernels.policy), "predictor_step": lambda _kernels: _sida_step(),
         "rowdot": lambda _kernels: _rowdot_products()}
