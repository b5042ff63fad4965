"""Under `--memory` the compiled kernels are in the process before the plan measures it, loaded
from numba's on-disk cache: where the cache lacks them child processes compile them, so that a
first run's plan measures the same process as every later run's; a command under `--memory`
refuses a cap too small before it compiles anything, and where its plan holds compiles what the
run calls while its process is small (started again)."""

from __future__ import annotations

import json
import os
import re
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


# `compile_ahead` (what `tune` and `bench` run first) in a process of its own: the parts its children
# loaded or compiled
COUNTING = textwrap.dedent("""
    import json
    from offload_runtime.engine import compiled
    parts, run_child = [], compiled._run_child
    compiled._run_child = lambda kernels, part: (parts.append(part), run_child(kernels, part))[1]
    compiled.compile_ahead()
    print(json.dumps(sorted(parts)))
""")
EVERY_PART = ["cache", "predictor_step", "rowdot"]


def test_compile_ahead_fills_a_fresh_cache_with_every_kernel_the_run_then_loads(tmp_path):
    assert _in_fresh_process(COUNTING, tmp_path) == EVERY_PART
    assert _in_fresh_process(LOADING, tmp_path) == {"children": 0, "warned": [], "compiled_after": []}
    # the stamp of what the children read holds: a later run spawns nothing, until a file they read changes
    assert _in_fresh_process(COUNTING, tmp_path) == []
    for index in tmp_path.rglob("*.nbi"):
        os.utime(index)
    assert _in_fresh_process(COUNTING, tmp_path) == EVERY_PART
    assert _in_fresh_process(COUNTING, tmp_path) == []


def test_compiling_children_run_two_at_once_where_the_cgroup_leaves_room_for_two(monkeypatch):
    monkeypatch.setattr(compiled.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(compiled, "process_footprint", lambda reads=True: 100 * MiB)
    monkeypatch.setattr(compiled, "cgroup_limit", lambda: None)
    assert compiled._at_once(3) == 2
    monkeypatch.setattr(compiled, "cgroup_limit", lambda: 100 * MiB + 2 * compiled.CHILD_BYTES)
    assert compiled._at_once(3) == 2
    monkeypatch.setattr(compiled, "cgroup_limit", lambda: 100 * MiB + 2 * compiled.CHILD_BYTES - 1)
    assert compiled._at_once(3) == 1
    monkeypatch.setattr(compiled, "cgroup_limit", lambda: 50 * MiB)
    assert compiled._at_once(3) == 1


# `prescient CMD ...` with each compiling child recorded in the file RECORD (one JSON line: the part,
# the kernels, whether the process had imported torch or transformers by then); `main` given the
# process's own arguments (the command can be started again) or, with a first argument "in-process",
# the rest (a caller's process: it cannot)
COMMAND = textwrap.dedent("""
    import json, os, sys
    from offload_runtime.engine import compiled
    run_child = compiled._run_child
    def recording(kernels, part):
        record = {"part": part, "kernels": kernels.__dict__,
                  "imported": [m for m in ("torch", "transformers") if m in sys.modules]}
        with open(os.environ["RECORD"], "a") as file:
            file.write(json.dumps(record) + "\\n")
        return run_child(kernels, part)
    compiled._run_child = recording
    from cli.main import main
    main(sys.argv[2:] if sys.argv[1:2] == ["in-process"] else sys.argv[1:])
""")


def _command(tmp_path, *argv: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """`prescient ARGV` as COMMAND runs it, with numba's cache in tmp_path/numba: how it ended, and
    the compiling children it ran (COMMAND's records)."""
    record = tmp_path / "children.jsonl"
    record.unlink(missing_ok=True)
    done = subprocess.run([sys.executable, "-c", COMMAND, *argv], capture_output=True, text=True, timeout=600,
                          cwd=ROOT, env=dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"), RECORD=str(record)))
    children = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    return done, children


def _generate(model, memory: str, *extra: str) -> list[str]:
    return ["generate", "--model", str(model), "--memory", memory, "--prompt", "def f(x):", "--max-new-tokens", "3",
            *extra]


def test_a_fresh_checkout_refuses_a_cap_too_small_before_it_compiles_anything(tiny_moe_dir, tmp_path):
    """The refusal comes from the plan, which the loader checks before the kernels: a cap too small
    spawns no compiling child (they took 13 s of runs/tb's 20 s first refusal)."""
    done, children = _command(tmp_path, *_generate(tiny_moe_dir("mixtral"), "64MiB"))
    assert done.returncode == 2 and "smallest memory that works" in done.stderr.splitlines()[-1], done.stderr[-800:]
    assert children == []


def test_a_fresh_checkout_whose_plan_holds_starts_again_compiling_only_what_the_run_calls(tiny_moe_dir, tmp_path):
    """Where the plan holds and numba's cache lacks the kernels, the command starts again and
    compiles, before it imports torch, the kernels of the policy it resolved (LRU without a
    predictor: no predictor step); the next run spawns nothing."""
    model = tiny_moe_dir("mixtral")
    refused, _ = _command(tmp_path, *_generate(model, "64MiB"))
    smallest = int(re.search(r"\((\d+)MiB\)", refused.stderr).group(1))
    argv = _generate(model, f"{smallest + 2}MiB", "--json", str(tmp_path / "run.json"))
    done, children = _command(tmp_path, *argv)
    assert done.returncode == 0, done.stderr[-800:]
    assert "starting the command again" in done.stderr
    assert not json.loads((tmp_path / "run.json").read_text())["memory_plan"]["resident"]
    assert sorted(child["part"] for child in children) == ["cache", "rowdot"]
    assert all(child["kernels"] == {"policy": "lru", "predictor_step": False} and child["imported"] == []
               for child in children)
    again, children = _command(tmp_path, *argv)
    assert again.returncode == 0 and children == [] and "starting the command again" not in again.stderr


def test_a_command_run_inside_a_callers_process_compiles_every_kernel_before_it_imports_torch(tiny_moe_dir,
                                                                                            tmp_path):
    """`main(argv)` called by a process that runs more than the command cannot be started again: it
    compiles every kernel a run may call first, while it holds neither torch nor the model."""
    done, children = _command(tmp_path, "in-process", *_generate(tiny_moe_dir("mixtral"), "64MiB"))
    assert done.returncode == 2
    assert sorted(child["part"] for child in children) == EVERY_PART
    assert all(child["kernels"] == {"policy": None, "predictor_step": True} and child["imported"] == []
               for child in children)


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


def test_a_command_that_may_start_again_refuses_before_the_kernels_load_a_cap_without_room_for_them(
        tiny_moe_dir, monkeypatch):
    """Where the command may start again to compile them (`compiled.prepare_command`), the loader
    checks the plan before the kernels load, counting what they will add: a cap with room for the
    process and one layer's slots but not for the kernels is refused with nothing loaded, as a run
    that loads them first refuses it (runs/tb's first refusal then takes the 6 s of a later one)."""
    path, directory, _ = _model(tiny_moe_dir)
    cap = _slot_cap(path, directory, 2)
    events = []
    _recording_load(monkeypatch, events)
    monkeypatch.setitem(compiled._restart, "allowed", True)
    with pytest.raises(CapacityError, match="smallest memory that works"):
        loader.load_offloaded(path, memory=cap)
    assert "kernels" not in events


@pytest.mark.parametrize("command, restarts", [(["generate", "--prompt", "x"], True), (["serve"], False),
                                               (["serve", "--replicas", "2"], False)])
def test_only_a_command_that_loads_before_it_serves_may_start_again(command, restarts, monkeypatch):
    """`serve` binds its port before it loads the model: started again to compile, its second self
    found the port held by its first ("address already in use"), so it compiles every kernel ahead,
    as do its replicas, which load in processes of their own."""
    from cli.args import compile_kernels_ahead
    from cli.main import build_parser

    asked = []
    monkeypatch.setattr(compiled, "prepare_command", asked.append)
    parser, _ = build_parser(command[0])
    compile_kernels_ahead(parser.parse_args([*command, "--model", "m", "--memory", "1GiB"]), restartable=True)
    assert asked == [restarts]
