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
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
from numba.core import event
from numba.core.caching import NullCache

from cache import make_serving_policy
from cache.expert_cache import load_kernels
from offload_runtime.engine import rowdot
from predictor import sida_decode

log = logging.getLogger(__name__)

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder the child imports this code from
CHILD_TIMEOUT_S = 600.0
# what loading the kernels from numba's cache adds to a process (numba's runtime, their machine code):
# on runs/tb a refusal before they load named 447 MiB, one after 475 (results/refusal-tb.json)
LOADED_BYTES = 28 * 2**20


@dataclass(frozen=True)
class Kernels:
    """Which kernels a run calls: the serving cache's with eviction `policy`, and SiDA's fused
    decode step where a SiDA predictor runs (`predictor_step`). Their machine code is the same
    whatever the model's sizes: they are called on throwaway data of two of everything."""

    policy: str
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


# the child imports only the kernels' own modules: stand-ins for the packages whose `__init__` imports
# the whole runtime (transformers and all), and for torch, which the kernels' modules import but the
# child calls none of (147 MB of anonymous memory beside a process under a cap, for nothing)
CHILD = """
import sys, types
sys.path.insert(0, sys.argv[1])
sys.modules["torch"] = types.ModuleType("torch")
for name in ("offload_runtime", "offload_runtime.engine", "predictor"):
    package = types.ModuleType(name)
    package.__path__ = [sys.argv[1] + "/" + name.replace(".", "/")]
    sys.modules[name] = package
from offload_runtime.engine.compiled import compile_here
compile_here(sys.argv[2], sys.argv[3])
"""


def compile_in_child(kernels: Kernels) -> None:
    """Run `compile_here` in child processes of the same python, one after the other for each part
    of `kernels` and for the expert kernel's product (the compiler's memory is one part's at a
    time: 70-125 MB on runs/tb's kernels against 170 MB for all in one), each compiling and saving
    what numba's cache lacks; a child that fails is logged (the kernels then compile here)."""
    parts = ["cache", *(["predictor_step"] if kernels.predictor_step else []), "rowdot"]
    for part in parts:
        argv = [sys.executable, "-c", CHILD, str(PACKAGE_ROOT), json.dumps(asdict(kernels)), part]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.warning("compiling the kernels (%s) in a child process failed (%s)", part, exc)
            continue
        if done.returncode != 0:
            log.warning("compiling the kernels (%s) in a child process failed (exit %s): %s", part, done.returncode,
                        " ".join(done.stderr.strip().splitlines()[-1:]))


def compile_here(kernels_json: str, part: str) -> None:
    """A child's work: one part of `Kernels` (as JSON): "cache" (the serving cache's kernels),
    "predictor_step" (SiDA's) or "rowdot" (the expert kernel's product)."""
    policy = Kernels(**json.loads(kernels_json)).policy
    {"cache": lambda: _cache_kernels(policy), "predictor_step": _sida_step, "rowdot": _rowdot_products}[part]()


def _call(kernels: Kernels) -> None:
    """Run each of `kernels` once on throwaway data."""
    _cache_kernels(kernels.policy)
    if kernels.predictor_step:
        _sida_step()


def _cache_kernels(policy: str) -> None:
    """The serving cache's kernels with eviction `policy` (`load_kernels`), on two layers."""
    load_kernels(make_serving_policy(policy, 2), 2, 4, 2)


def _sida_step() -> None:
    """SiDA's fused decode step once, on weights of two of everything (the arrays' kinds, not their
    sizes, decide its machine code)."""
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
    weight, row, out = np.zeros((2, 2), np.float32), np.zeros(2, np.float32), np.zeros(2, np.float32)
    for threads in (1, 2):
        rowdot.rows_product(weight, row, out, threads)
