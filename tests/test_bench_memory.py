"""`prescient bench --memory`: the zero-copy mmap model is exact against the plain model, the
cgroup runner reports a kill under a cap far too small, the orchestrator writes killed runs and
its summary into the JSON, and a bad size is one error line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from cli.main import main
from experiments.bench_memory import orchestrate
from prescient.capped_run import CappedRun, cgroup_kind, run_capped
from experiments.bench_memory.child import run as run_child
from offload_runtime.engine.mapped import load_mmap_model, mapped_share
from prescient.model_dir import ModelDirectory, model_class

PROMPT = "def wrap(text, width=70):\n    return"


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_mmap_model_is_zero_copy_and_exact(tiny_moe_dir, arch):
    directory = ModelDirectory.open(tiny_moe_dir(arch))
    plain = model_class(directory.config).from_pretrained(directory.path).eval()
    mapped, _ = load_mmap_model(directory)
    assert mapped_share(mapped) == 1.0  # every weight, the experts' pieces too, lies inside the file mappings
    ids = directory.tokenizer()(PROMPT, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        assert torch.equal(plain(ids).logits, mapped(ids).logits)
        greedy = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0}
        assert torch.equal(plain.generate(ids, **greedy), mapped.generate(ids, **greedy))


def test_child_systems_agree(tiny_moe_dir, tmp_path):
    """Every system computes the plain model's tokens; the plain run traces its own sequence, and
    the oracle read from that trace predicts every expert the run uses."""
    spec = {"model": str(tiny_moe_dir("mixtral")), "prompt": PROMPT, "new_tokens": 8, "threads": 1, "memory": None,
            "oracle_trace": str(tmp_path / "oracle")}
    plain, mapped, lru, oracle = (run_child({**spec, "system": system})
                                  for system in ("plain", "mmap", "no-predictor", "oracle"))
    assert len(plain["token_ids"]) == 8
    assert plain["token_ids"] == mapped["token_ids"] == lru["token_ids"] == oracle["token_ids"]
    assert plain["tokens_per_s"] > 0 and mapped["mapped_share"] == 1.0
    assert lru["runtime"]["stats"]["prefetch_inserts"] == 0 and oracle["runtime"]["tables_on_time"] == 1.0
    assert oracle["runtime"]["stats"]["prefetch_hits"] > 0 and oracle["runtime"]["wasted_bytes_per_token"] == 0


@pytest.mark.skipif(cgroup_kind() == "none", reason="no writable memory cgroup on this machine")
def test_cgroup_runner_reports_a_kill():
    cap = 32 * 2**20
    killed = run_capped([sys.executable, "-c", "x = b'1' * 400_000_000"], cap, timeout_s=60)
    assert killed.killed and killed.capped and not killed.timed_out
    assert killed.peak_bytes is not None and killed.peak_bytes <= cap
    fine = run_capped([sys.executable, "-c", "pass"], 256 * 2**20, timeout_s=60)
    assert fine.returncode == 0 and not fine.killed and fine.peak_bytes > 0


def _fake_runner(speeds: dict[tuple[str, int | None], float | None]):
    """A runner that answers from `speeds` ((system, cap[, prompt]) -> tokens/s, or a list of them taken
    one per run in turn; None: killed; "refused") without a child."""

    def run(argv: list[str], cap: int | None, _timeout: float) -> CappedRun:
        spec = json.loads(Path(argv[-2]).read_text())
        speed = speeds.get((spec["system"], cap, spec.get("prompt_index")), speeds.get((spec["system"], cap), 10.0))
        if isinstance(speed, list):
            speed = speed.pop(0)
        if speed == "refused":
            Path(argv[-1]).write_text(json.dumps({"refused": "--memory 50 MiB cannot hold this model"}))
        elif speed is not None:
            ids = [1, 2, 3] if spec["system"] != "mmap" else [1, 2, 4]  # mmap inexact, to see it marked
            reads = {"decode_read_bytes_per_token": 2**20 * speed} if spec["system"] == "mmap" else {}  # counted
            Path(argv[-1]).write_text(json.dumps({"token_ids": ids, "tokens_per_s": speed, "prefill_seconds": 0.1,
                                                  **reads}))
        return CappedRun(0 if speed is not None else -9, speed is None, False, cap or 400, cap, True, "v1",
                         int(speed is None), 0, 0.1, "")

    return run


def test_orchestrator_writes_killed_runs_and_summary(tmp_path):
    tiny, small, big = 50 * 2**20, 100 * 2**20, 2**30
    runner = _fake_runner({("plain", small): None, ("mmap", small): 4.0, ("prescient", small): 6.0,
                           ("plain", big): 20.0, ("prescient", big): 19.0,
                           ("plain", tiny): None, ("mmap", tiny): None, ("prescient", tiny): "refused"})
    out = tmp_path / "curve.json"
    orchestrate.bench_memory("model", [big, small, tiny], [PROMPT], json_path=out, plot_path=tmp_path / "curve.png",
                             new_tokens=4, repeats=2, runner=runner, predictor="p", systems=("plain", "mmap", "prescient"))
    result = json.loads(out.read_text())
    rounds = [[r["system"] for r in result["runs"][i:i + 3]] for i in range(0, 12, 3)]  # big: 2 repeats, then small
    assert rounds == [["plain", "mmap", "prescient"], ["mmap", "prescient", "plain"],  # interleaved, order rotated
                      ["plain", "mmap", "prescient"], ["mmap", "prescient", "plain"]]
    killed = [(r["system"], r["cap_bytes"]) for r in result["runs"] if r["status"] == "killed"]
    assert sorted(set(killed)) == sorted({("plain", small), ("plain", tiny), ("mmap", tiny)}) and len(killed) == 6
    assert {r["status"] for r in result["runs"] if r["cap_bytes"] == tiny and r["system"] == "prescient"} == {"refused"}
    by = {(s["system"], s["cap_bytes"]): s for s in result["summary"]}
    assert by["plain", small]["killed"] == 2 and by["plain", small]["tokens_per_s"] is None
    assert by["prescient", big]["exact"] and by["mmap", big]["exact"] is False
    assert by["mmap", small]["read_bytes_per_token"]["median"] == 4 * 2**20  # of the runs that counted
    assert by["prescient", small]["read_bytes_per_token"] is None and by["mmap", tiny]["read_bytes_per_token"] is None
    ratio = {r["cap_bytes"]: r for r in result["ratios"]}
    assert ratio[big]["prescient/plain"] == pytest.approx(0.95) and ratio[small]["prescient/plain"] is None
    assert ratio[small]["prescient/mmap"] == pytest.approx(1.5)
    assert result["plain_stops"] == {"largest_killed_cap_bytes": small, "smallest_running_cap_bytes": big}
    assert result["floor"]["status"] == "ok" and "page cache" in result["how_counted"]
    assert (tmp_path / "curve.png").stat().st_size > 0


def test_prediction_is_judged_per_prompt_against_the_runtime_without_it(tmp_path):
    """Two prompts: the predictor wins on one and loses on the other; the oracle wins on both.
    Each system's ratio over no-predictor is taken per prompt, then its median over the prompts."""
    cap = 2**30
    runner = _fake_runner({("no-predictor", cap, 0): 10.0, ("prescient", cap, 0): 15.0, ("oracle", cap, 0): 20.0,
                           ("no-predictor", cap, 1): 20.0, ("prescient", cap, 1): 10.0, ("oracle", cap, 1): 24.0})
    out = tmp_path / "curve.json"
    orchestrate.bench_memory("model", [cap], [PROMPT, "import os\n"], json_path=out, new_tokens=4, repeats=2,
                             runner=runner, predictor="p")
    result = json.loads(out.read_text())
    assert result["settings"]["systems"] == [s for s in orchestrate.SYSTEMS if s not in ("llama.cpp", "next")]  # not given
    n = len(result["settings"]["systems"])
    assert [r["prompt_index"] for r in result["runs"][:2 * n]] == [0] * n + [1] * n  # interleaved per prompt
    assert len(result["references"]) == 2 and all(r["system"] == "plain" for r in result["references"])
    # each runtime system ran once untimed before the timed runs (its compiled kernels cached)
    assert result["warmups"] == {"no-predictor": "ok", "prescient": "ok", "prefetch": "ok", "oracle": "ok"}
    (cap_entry,) = result["per_prompt"]
    assert [row["over_no_predictor"]["prescient"] for row in cap_entry["prompts"]] == [1.5, 0.5]
    assert cap_entry["median_over_no_predictor"]["prescient"] == {"median": 1.0, "min": 0.5, "max": 1.5}
    assert cap_entry["median_over_no_predictor"]["oracle"]["median"] == pytest.approx(1.6)
    assert "oracle/no-predictor over 2 prompts: median 1.60" in orchestrate.summary_text(result)


def test_each_prompt_keeps_its_spread_and_the_ratios_repeat_by_repeat(tmp_path):
    """A ratio of medians hides how far the repeats differ: each prompt's entry keeps every system's
    range of tokens/s and its ratio over no-predictor within each repeat (the rounds interleave)."""
    cap = 2**30
    runner = _fake_runner({("no-predictor", cap): [10.0, 20.0, 12.0], ("prescient", cap): [15.0, 16.0, 12.0]})
    out = tmp_path / "curve.json"
    orchestrate.bench_memory("model", [cap], [PROMPT], json_path=out, new_tokens=4, repeats=3, runner=runner,
                             predictor="p", systems=("no-predictor", "prescient"))
    (row,) = json.loads(out.read_text())["per_prompt"][0]["prompts"]
    assert row["tokens_per_s_range"] == {"no-predictor": [10.0, 20.0], "prescient": [12.0, 16.0]}
    assert row["paired_over_no_predictor"]["prescient"] == pytest.approx([1.5, 0.8, 1.0])
    assert row["over_no_predictor"]["prescient"] == pytest.approx(15.0 / 12.0)  # of the medians


def test_a_slow_spell_shared_by_a_repeat_cancels_in_the_paired_statistic(tmp_path):
    """The disk slows every system of one repeat (its runs follow each other): the ratio of medians pairs
    the predictor's slow run with no predictor's fast one, each repeat's ratio does not."""
    cap = 2**30
    runner = _fake_runner({("no-predictor", cap): [8.0, 7.0, 4.0], ("prescient", cap): [7.5, 11.0, 6.5]})
    out = tmp_path / "curve.json"
    orchestrate.bench_memory("model", [cap], [PROMPT], json_path=out, new_tokens=4, repeats=3, runner=runner,
                             predictor="p", systems=("no-predictor", "prescient"))
    (cap_entry,) = json.loads(out.read_text())["per_prompt"]
    assert cap_entry["median_over_no_predictor"]["prescient"]["median"] == pytest.approx(7.5 / 7.0)
    paired = cap_entry["median_paired_over_no_predictor"]["prescient"]
    assert paired["median"] == pytest.approx(11.0 / 7.0) == paired["min"] == paired["max"]  # of 0.94, 1.57, 1.63


def test_the_prescient_system_needs_a_predictor(tmp_path):
    with pytest.raises(orchestrate.MemoryBenchError, match="--predictor"):
        orchestrate.bench_memory("model", [2**30], [PROMPT], json_path=tmp_path / "x.json", systems=("prescient",),
                                 runner=_fake_runner({}))


@pytest.mark.parametrize("sizes", ["1GiB,lots", "1GiB,0GiB", "512", "1GiB,1GiB"])
def test_bad_memory_sizes_are_one_error_line(tmp_path, capsys, sizes):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--model", str(tmp_path), "--json", str(tmp_path / "out.json"), "--memory", sizes])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and err.startswith("error:") and len(err.splitlines()) == 1
    assert not (tmp_path / "out.json").exists()
