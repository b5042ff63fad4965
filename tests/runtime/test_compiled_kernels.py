"""Under `--memory` the compiled kernels are in the process before the plan measures it, loaded
from numba's on-disk cache: where the cache lacks them a child process compiles them, so that a
first run's plan measures the same process as every later run's; a command under `--memory` has
them compiled before it imports torch, while its process is small."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from offload_runtime.engine import compiled, loader
from offload_runtime.engine.memory_plan import MiB
from prescient.errors import CapacityError
from tests.runtime.test_memory_guard import _slot_cap
from tests.runtime.test_memory_plan import FOOTPRINT, _model

# one process loading the kernels with numba's cache in NUMBA_CACHE_DIR: how often it compiled them in
# child processes, what numba compiled in the process itself (warned), and what it compiled after
LOADING = textwrap.dedent("""
    import json, logging
    from offload_runtime.engine import compiled
    children, warned = [], []
    run_child = compiled.compile_in_child
    compiled.compile_in_child = lambda kernels: (children.append(1), run_child(kernels))
    class Warned(logging.Handler):
        def emit(self, record):
            warned.append(record.getMessage())
    compiled.log.addHandler(Warned(logging.WARNING))
    compiled.load_compiled(compiled.Kernels("learned-belady", predictor_step=True))
    # then what the runtime runs after the plan: a SiDA predictor's step, the expert kernel's product
    import torch
    from torch import nn
    from offload_runtime.engine import rowdot
    from predictor import sida_decode
    from predictor.sida import SiDAHash, SiDASizes
    sizes = SiDASizes(compress_dim=4, hidden_dim=4, lstm_layers=2, attn_window=4)
    weights = sida_decode.DecodeWeights.of(SiDAHash(nn.Embedding(8, 4), 2, 4, sizes, horizon=1))
    with compiled.watching_compiles(refuse=False) as watch:
        sida_decode.step(weights, sida_decode.DecodeState.start(1, 2, 4, 4), torch.tensor([[1]]))
        for threads in (1, 2):
            torch.set_num_threads(threads)
            rowdot.product(torch.ones(1, 4), torch.ones(4, 4))
    print(json.dumps({"children": len(children), "warned": warned, "compiled_after": watch.compiled}))
""")


ROOT = Path(__file__).resolve().parents[2]


def _in_fresh_process(script: str, cache_dir, *argv: str) -> dict:
    """The last line of `script`'s output, as JSON, run with numba's cache in `cache_dir`."""
    done = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=600,
                          cwd=ROOT, env=dict(os.environ, NUMBA_CACHE_DIR=str(cache_dir)))
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_a_cache_without_the_kernels_is_filled_by_a_child_and_the_process_compiles_nothing(tmp_path):
    first = _in_fresh_process(LOADING, tmp_path)
    # the child compiled every kernel the process then loads, and those the runtime runs after its plan
    assert first == {"children": 1, "warned": [], "compiled_after": []}
    assert list(tmp_path.rglob("*.nbi"))
    assert _in_fresh_process(LOADING, tmp_path) == {"children": 0, "warned": [], "compiled_after": []}  # all found


# `compile_ahead` (what a command under `--memory` runs first) in a process of its own: the children
# it ran, by their work
COUNTING = textwrap.dedent("""
    import json
    from offload_runtime.engine import compiled
    works, run_child = [], compiled._run_child
    compiled._run_child = lambda what, work, *args: (works.append(work), run_child(what, work, *args))[1]
    compiled.compile_ahead()
    print(json.dumps(works))
""")


def test_compile_ahead_fills_a_fresh_cache_with_every_kernel_the_run_then_loads(tmp_path):
    assert _in_fresh_process(COUNTING, tmp_path) == ["missing_here", *["compile_here"] * 3, "missing_here"]
    assert _in_fresh_process(LOADING, tmp_path) == {"children": 0, "warned": [], "compiled_after": []}
    # the last lookup's stamp holds: a later run spawns nothing, until a file the lookup read changes
    assert _in_fresh_process(COUNTING, tmp_path) == []
    for index in tmp_path.rglob("*.nbi"):  # the lookup's among them
        os.utime(index)
    assert _in_fresh_process(COUNTING, tmp_path) == ["missing_here"]
    assert _in_fresh_process(COUNTING, tmp_path) == []


# `prescient CMD ...` with the compiling children stopped at their start: which parts they were to
# compile, and whether the command had imported torch or transformers by then
COMMAND = textwrap.dedent("""
    import json, sys
    from offload_runtime.engine import compiled
    def compile_in_child(kernels, parts=None):
        print(json.dumps({"parts": parts, "imported": [m for m in ("torch", "transformers") if m in sys.modules]}))
        raise SystemExit(0)
    compiled.compile_in_child = compile_in_child
    from cli.main import main
    main(sys.argv[1:])
""")


@pytest.mark.parametrize("command", [["generate", "--prompt", "x"], ["serve"],
                                     ["trace", "--dataset", "stdlib-code", "--out", "TMP/trace"]])
def test_a_command_under_memory_compiles_what_the_cache_lacks_before_it_imports_torch(tmp_path, command):
    """A fresh checkout's first `--memory` run: by the loader's turn the process holds torch, the
    libraries and the weights, and the compiler children had no room beside it under the cap."""
    named = [arg.replace("TMP", str(tmp_path)) for arg in command]
    record = _in_fresh_process(COMMAND, tmp_path / "numba", named[0], "--model", "unused", "--memory", "480MiB", *named[1:])
    assert record == {"parts": ["cache", "predictor_step", "rowdot"], "imported": []}


def _recording_load(monkeypatch, events: list) -> None:
    """The loader's kernel loading and footprint measurements recorded in `events`, in order; each
    measurement FOOTPRINT plus its position, so that the plan's footprint says which one it took."""
    monkeypatch.setattr(loader, "load_compiled", lambda kernels: events.append("kernels"))

    def footprint(reads=True):
        events.append("measured")
        return FOOTPRINT + len(events)

    monkeypatch.setattr(loader, "process_footprint", footprint)


def test_the_plan_measures_the_process_after_the_kernels_are_loaded(tiny_moe_dir, monkeypatch):
    path, directory, _ = _model(tiny_moe_dir)
    cap = _slot_cap(path, directory, 12)
    events = []
    _recording_load(monkeypatch, events)
    with loader.load_offloaded(path, memory=cap) as model:
        measured_at = model.runtime.memory_plan.footprint - FOOTPRINT - 1  # the events before its measurement
    assert "kernels" in events[:measured_at]


def test_a_cap_that_cannot_hold_any_slots_is_refused_before_the_kernels_load(tiny_moe_dir, monkeypatch):
    """Below the least a plan of slots needs (from the shapes, before the weights) nothing compiled
    is loaded (under a cgroup that would only slow the refusal); the refusal comes after the weights
    and names a cap that holds the kernels too."""
    path, _, _ = _model(tiny_moe_dir)
    events = []
    _recording_load(monkeypatch, events)
    with pytest.raises(CapacityError, match="smallest memory that works") as refused:
        loader.load_offloaded(path, memory=FOOTPRINT + MiB)
    assert "kernels" not in events
    named = int(str(refused.value).rsplit("(", 1)[1].split("MiB")[0]) * MiB
    assert named >= FOOTPRINT + compiled.LOADED_BYTES  # the cap named counts the kernels it will load
