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

The commands that take `--memory` call `compile_ahead` first, before they import torch or the
model: by the loader's turn the process holds torch, transformers and the non-expert weights
(about 400 MiB on runs/tb), and under a cap just above that the compiler children (70-125 MB each)
found no room beside it (a fresh checkout's first run at 480 MiB never finished,
results/refusal-tb-first-run-480.json). It has a child look every kernel up in numba's cache
(`missing_here`), others compile what it found missing, and once a lookup finds them all it keeps
what it found in a stamp (`STAMP`: each file the lookup read, with its time and size); a later run
whose stamp still holds spawns nothing. This module imports no torch (the kernels' modules that do
are imported where they are called) so that a command can call it that early.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
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

log = logging.getLogger(__name__)

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder the child imports this code from
CHILD_TIMEOUT_S = 600.0
# what loading the kernels from numba's cache adds to a process (numba's runtime, their machine code):
# on runs/tb a refusal before they load named 447 MiB, one after 475 (results/refusal-tb.json)
LOADED_BYTES = 28 * 2**20
KERNEL_PACKAGES = ("cache", "predictor", "offload_runtime")  # the packages whose modules hold the kernels
STAMP = "runtime-kernels-found.json"  # `compile_ahead`'s, in numba's cache folder or this module's `__pycache__`


@dataclass(frozen=True)
class Kernels:
    """Which kernels a run calls: the serving cache's with eviction `policy` (None: every serving
    policy's, where the policy is not resolved yet), and SiDA's fused decode step where a SiDA
    predictor runs (`predictor_step`). Their machine code is the same whatever the model's sizes:
    they are called on throwaway data of two of everything."""

    policy: str | None
    predictor_step: bool


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
        log.info("numba's cache lacks %s: compiling the runtime's kernels in a child process", missing)
    compile_in_child(kernels)
    with watching_compiles(refuse=False) as watch:
        _call(kernels)
    if watch.compiled:
        log.warning("numba compiled %s in this process (its cache could not keep them): a memory plan counts "
                    "the compiler's memory as the process's", ", ".join(watch.compiled))


def compile_ahead() -> None:
    """Put every kernel a run may load (`AHEAD`) and the expert kernel's product in numba's cache
    where it lacks them, compiled by child processes, loading none into this process (see the
    module's doc): unless the stamp of an earlier lookup still holds, a child looks them up, others
    compile what it found missing, and a second lookup keeps the stamp. `load_compiled` then finds
    them all; a lookup that fails is logged and leaves them to it."""
    if _stamp_holds():
        return
    missing = _look_up()
    if missing:
        log.info("numba's cache lacks the runtime's kernels (%s): compiling them in child processes", ", ".join(missing))
        compile_in_child(AHEAD, missing)
        _look_up()  # keeps the stamp


def _look_up() -> list[str] | None:
    """The parts of `AHEAD` numba's cache lacks, looked up by a child (None: it failed); where it
    lacks none, the lookup's stamp kept."""
    found = _run_child("looking the kernels up in numba's cache", "missing_here", AHEAD)
    if found is None:
        return None
    record = json.loads(found.splitlines()[-1])
    if not record["missing"]:
        _keep_stamp(record["stamp"])
    return record["missing"]


def _stamp_path() -> Path:
    """Where `compile_ahead` keeps its stamp: numba's cache folder where one is set, else beside this module."""
    return Path(config.CACHE_DIR or Path(__file__).parent / "__pycache__") / STAMP


def _stamp(files) -> dict:
    """What a lookup that read `files` depends on: numba, the python, each file's time and size."""
    stats = {}
    for path in sorted(files):
        try:
            stat = os.stat(path)
            stats[path] = [stat.st_mtime_ns, stat.st_size]
        except OSError:
            stats[path] = None
    return {"numba": numba.__version__, "python": sys.executable, "files": stats}


def _stamp_holds() -> bool:
    """Whether a lookup's stamp was kept and nothing it depends on changed since."""
    try:
        kept = json.loads(_stamp_path().read_text())
    except (OSError, ValueError):
        return False
    return isinstance(kept, dict) and bool(kept.get("files")) and kept == _stamp(kept["files"])


def _keep_stamp(stamp: dict) -> None:
    """Write `stamp` where `_stamp_holds` reads it."""
    try:
        write_json_atomic(_stamp_path(), stamp)
    except (OSError, PrescientError) as exc:  # a folder not writable: each run then looks the kernels up
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
getattr(compiled, sys.argv[2])(compiled.Kernels(**json.loads(sys.argv[3])), *sys.argv[4:])
"""


def _run_child(what: str, work: str, kernels: Kernels, *args: str) -> str | None:
    """Run this module's function `work` on `kernels` and `args` in a child process of the same
    python (`CHILD`); its output, or None where it failed (logged as `what` failing)."""
    argv = [sys.executable, "-c", CHILD, str(PACKAGE_ROOT), work, json.dumps(asdict(kernels)), *args]
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


def compile_in_child(kernels: Kernels, parts: list[str] | None = None) -> None:
    """Run `compile_here` in child processes of the same python, one after the other for each of
    `parts` (default: every part of `kernels`, `_parts`), each compiling and saving what numba's
    cache lacks (the compiler's memory is one part's at a time: 70-125 MB on runs/tb's kernels
    against 170 MB for all in one); a child that fails is logged (the kernels then compile here)."""
    for part in parts or _parts(kernels):
        _run_child(f"compiling the kernels ({part})", "compile_here", kernels, part)


def compile_here(kernels: Kernels, part: str) -> None:
    """A child's work: one part of `kernels` (`_parts`), compiled where numba's cache lacks it."""
    PARTS[part](kernels)


def missing_here(kernels: Kernels) -> None:
    """A child's work: print (as JSON) the parts of `kernels` that numba's cache lacks, and the stamp
    of the files it read (`_stamp`)."""
    missing = []
    for part in _parts(kernels):
        try:
            with watching_compiles(refuse=True):
                PARTS[part](kernels)
        except CompileNeeded:
            missing.append(part)
    print(json.dumps({"missing": missing, "stamp": _stamp(_cache_files())}))


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


# what `compile_ahead` compiles: whatever policy and predictor the run resolves later (with torch)
AHEAD = Kernels(None, predictor_step=True)
# each part of the kernels a child compiles (`compile_here`) or looks up (`missing_here`)
PARTS = {"cache": lambda kernels: _cache_kernels(kernels.policy), "predictor_step": lambda _kernels: _sida_step(),
         "rowdot": lambda _kernels: _rowdot_products()}
