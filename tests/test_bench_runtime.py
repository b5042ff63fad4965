"""`prescient bench` on a tiny random Mixtral: the grid helpers, a 2-run benchmark with both
baselines, the oracle and the hash thread's cost with a (random) SiDA artifact, in this
process, and the command line with every configuration in its own forked process. Real
checkpoints, threads and files."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from cli import bench as bench_cli
from experiments.bench_runtime import bench
from experiments.bench_runtime.records import NotExactError
from experiments.bench_runtime.grid import (BASELINES, BenchError, RunSpec, check_grid, default_grid, full_grid,
                                            parse_runs)
from prescient.fingerprint import fingerprint_model
from prescient.loading import load_model
from tests.conftest import random_sida
from training.tracing import trace_model

RECORD_FIELDS = {"label", "tokens_per_s", "peak_rss_mb", "exact", "decode_tokens", "decode_seconds",
                 "prefill_seconds", "load_seconds", "rss_after_load_mb", "load_peak_rss_mb", "peak_rss_scope"}
RUN_FIELDS = RECORD_FIELDS | {"budget", "predictor", "policy", "hit_rate", "stall_seconds", "bytes_moved",
                              "late_tables", "stats"}


def corpus_texts(text_corpus) -> list[str]:
    return [json.loads(line)["text"] for line in text_corpus.read_text().splitlines()]


def test_grids_and_their_checks():
    grid = default_grid([0.25, 0.5], ["none", "freq", "sida"], ["lru", "lfu", "fifo", "mrs"])
    assert [r.label for r in grid[:7]] == ["none+lru@0.25", "freq+mrs@0.25", "freq+lru@0.25", "sida+mrs@0.25",
                                           "sida+lru@0.25", "sida+lfu@0.25", "sida+fifo@0.25"]
    assert len(grid) == 14 and {r.budget for r in grid[7:]} == {0.5}
    assert len(full_grid([0.5, 1.0], ["none", "freq"], ["lru", "mrs"])) == 8
    runs = parse_runs("none:lru@0.5, sida:mrs@0.25")
    assert runs == [RunSpec("none", "lru", 0.5), RunSpec("sida", "mrs", 0.25)]
    for bad in ("none@0.5", "none:lru", "none:lru@half"):
        with pytest.raises(BenchError, match="PREDICTOR:POLICY@BUDGET"):
            parse_runs(bad)
    with pytest.raises(BenchError, match="--train-trace"):
        check_grid([RunSpec("freq", "lru", 0.5)], {"freq": None}, None)
    with pytest.raises(BenchError, match="unknown policy"):
        check_grid([RunSpec("none", "clock", 0.5)], {"none": None}, None)
    with pytest.raises(BenchError, match="does not name"):
        check_grid([RunSpec("oracle", "lru", 0.5)], {"none": None}, None)
    with pytest.raises(BenchError, match="unknown predictor"):
        check_grid([], {"magic": None}, None)


@pytest.mark.slow  # 9 s of runs and baselines in child processes
def test_two_runs_baselines_oracle_and_hash_cost(tiny_moe_dir, text_corpus, tmp_path):
    model = tiny_moe_dir("mixtral")
    out, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    predictors = {"none": None, "oracle": None, "sida": str(random_sida(model, tmp_path)), "freq": None}
    result = bench.bench_runtime(
        model, corpus_texts(text_corpus), predictors=predictors, runs=parse_runs("none:lru@0.5,oracle:mrs@0.25"),
        new_tokens=6, hash_cost_predictor="sida", isolate=False, json_path=out, plot_path=plot)
    assert json.loads(out.read_text()) == json.loads(json.dumps(result)) and result["complete"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {"settings", "machine", "model", "method", "prompts", "ratios"} <= set(result)
    assert {"cpu_count", "torch_threads", "platform"} <= set(result["machine"])
    assert set(result["settings"]["predictors"]) == {"none", "oracle", "sida"}  # freq: no run uses it
    m = result["model"]
    assert m["total_expert_bytes"] == m["expert_bytes"] * m["n_experts"] * m["n_moe_layers"] > 0

    runs = result["runs"]
    assert [r["label"] for r in runs] == ["none+lru@0.5", "oracle+mrs@0.25"]
    for record in runs:
        assert RUN_FIELDS <= set(record) and "error" not in record, record
        assert record["exact"] and record["tokens_per_s"] > 0 and record["peak_rss_mb"] > 0
        assert record["decode_tokens"] == 5 * result["settings"]["timed_prompts"]
        assert record["stats"]["forwards"] == record["decode_tokens"]  # decode windows only, prefill excluded
    oracle = runs[1]["stats"]
    assert oracle["tables_on_time"] + oracle["late_tables"] == oracle["forwards"]  # every table known to the oracle
    assert runs[1]["stats"]["slots"] == 4 and runs[0]["stats"]["slots"] == 8  # 25% and 50% of 2 x 8 experts
    for name in BASELINES:
        record = result["baselines"][name]
        assert RECORD_FIELDS <= set(record) and record["exact"] and record["tokens_per_s"] > 0, record
    assert result["baselines"]["accelerate_disk"]["offloaded_modules"] == 2

    cost = result["hash_thread_cost"]
    for key in ("with_thread_tables_ignored", "without_thread"):
        record = cost[key]
        assert record["exact"] and record["stats"]["loads"] == 0 and record["bytes_moved"] == 0, record
        assert record["stats"]["prefetch_inserts"] == 0 and record["hit_rate"] == 1.0
    threaded, plain = cost["with_thread_tables_ignored"]["stats"], cost["without_thread"]["stats"]
    assert threaded["tables_on_time"] + threaded["late_tables"] == threaded["forwards"]  # the thread ran
    assert plain["tables_on_time"] + plain["late_tables"] == 0
    assert cost["tokens_per_s_ratio"] > 0
    ratio = result["ratios"]["none+lru@0.5"]
    assert ratio["vs_none_lru"] == 1.0 and ratio["vs_all_resident"] > 0 and ratio["vs_accelerate_disk"] > 0


def test_sampled_decoding_draws_alike_in_every_run(tiny_moe_dir, text_corpus, tmp_path):
    """With a sample seed every run samples the same tokens as the all-resident model, the oracle
    (recorded while sampling) knows every prefix, and the tokens are not the greedy ones."""
    model = tiny_moe_dir("qwen3_moe")
    result = bench.bench_runtime(
        model, corpus_texts(text_corpus), predictors={"oracle": None}, runs=parse_runs("oracle:lru@0.5"),
        new_tokens=6, baseline_tokens=3, sample_seed=7, isolate=False)
    assert result["settings"]["sample_seed"] == 7
    run, = result["runs"]
    assert run["exact"] and result["baselines"]["accelerate_disk"]["exact"]
    stats = run["stats"]  # every forward acted on the oracle's table, or ran with predictions paused by the guard
    assert stats["tables_on_time"] + stats["late_tables"] + stats["prediction_paused_forwards"] == stats["forwards"]
    greedy = bench.bench_runtime(model, corpus_texts(text_corpus), predictors={"none": None},
                                 runs=parse_runs("none:lru@0.5"), new_tokens=6, baselines=("all_resident",),
                                 isolate=False)
    sampled_ids = result["baselines"]["all_resident"]["token_ids"]
    assert greedy["runs"][0]["exact"] and greedy["baselines"]["all_resident"]["token_ids"] != sampled_ids


@pytest.mark.slow  # 15 s: a fresh process per configuration; the default suite ran 639 s on a fresh clone
def test_command_line_runs_each_configuration_in_a_fresh_process(tiny_moe_dir, text_corpus, tmp_path):
    """Three processes besides this one; corr is fit on a train trace; a run that fails (its
    artifact lost its tensors) is recorded with the error, the others go on, and the bench then
    fails naming it."""
    model = tiny_moe_dir("mixtral")
    broken = random_sida(model, tmp_path)
    broken.with_suffix(".safetensors").unlink()
    trace = trace_model(model, f"json:{text_corpus}", tmp_path / "trace", split="train", max_tokens=500)
    parser = argparse.ArgumentParser()
    bench_cli.add_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "bench.json"
    args = parser.parse_args([
        "bench", "--model", str(model), "--json", str(out), "--predictors", f"none,corr,broken={broken}",
        "--train-trace", str(trace), "--runs", "none:lru@1.0,broken:lru@0.5,corr:fifo@0.5",
        "--baselines", "all_resident", "--dataset", f"json:{text_corpus}", "--split", "train", "--prompts", "1",
        "--new-tokens", "3", "--threads", "1"])
    with pytest.raises(NotExactError, match=r"1 run\(s\) failed .*: broken\+lru@0\.5;"):
        bench_cli.run(args)
    result = json.loads(out.read_text())  # every run recorded; never complete with one not exact
    assert not result["complete"] and result["settings"]["isolated_processes"]
    good = [result["baselines"]["all_resident"], result["runs"][0], result["runs"][2]]
    assert all(r["exact"] and r["peak_rss_scope"] == "after load (VmHWM reset)" for r in good), good
    pids = {r["pid"] for r in good}
    assert len(pids) == 3 and os.getpid() not in pids
    assert result["runs"][2]["stats"]["tables_on_time"] + result["runs"][2]["stats"]["late_tables"] == 2
    failed = result["runs"][1]
    assert failed["label"] == "broken+lru@0.5" and not failed["exact"] and "missing" in failed["error"]
    assert "accelerate_disk" not in result["baselines"] and result["hash_thread_cost"] is None


def test_simulate_puts_the_simulators_prediction_beside_each_run(tiny_moe_dir, text_corpus, tmp_path):
    """`simulate`: every run gains the time-true simulator's figures on the recorded generation, with
    the bench's own slots and a link calibrated from this bench; the agreement is computed."""
    model = tiny_moe_dir("mixtral")
    runs = parse_runs("none:lru@0.5,oracle:lru@0.5,none:lru@0.25,none:lru@0.5")
    with pytest.raises(BenchError, match="all_resident"):
        bench.bench_runtime(model, corpus_texts(text_corpus), predictors={"none": None}, runs=runs[:1],
                            baselines=("accelerate_disk",), simulate=True, isolate=False)
    with pytest.raises(BenchError, match="without a predictor"):
        bench.bench_runtime(model, corpus_texts(text_corpus), predictors={"oracle": None}, runs=runs[1:2],
                            baselines=("all_resident",), simulate=True, isolate=False)
    result = bench.bench_runtime(model, corpus_texts(text_corpus), predictors={"none": None, "oracle": None},
                                 runs=runs, new_tokens=6, baselines=("all_resident",), simulate=True, isolate=False)
    assert result["model"]["fingerprint"] == fingerprint_model(*load_model(model)).to_dict()
    for run in result["runs"]:
        sim = run["simulated"]
        assert sim["slots"] == run["stats"]["slots"] and sim["tokens_per_s"] > 0 and 0 <= sim["hit_rate"] <= 1
    first, oracle, quarter, again = (r["simulated"] for r in result["runs"])
    assert first == again  # one simulation per distinct run
    headline = result["ratios"]["none+lru@0.5"]  # the median of its two repeats
    assert headline["repeats"] == 2 and headline["vs_none_lru"] == 1.0
    assert headline["tokens_per_s_range"][0] <= headline["tokens_per_s"] <= headline["tokens_per_s_range"][1]
    assert oracle["hit_rate"] > first["hit_rate"]  # prefetching the router's true choices
    assert quarter["mb_moved_per_token"] > first["mb_moved_per_token"]  # fewer slots, more loads
    simulator = result["simulator"]
    assert simulator["calibration"]["source"]["kind"] == "bench"
    agreement = simulator["agreement"]
    assert [r["label"] for r in agreement["runs"]] == ["none+lru@0.5", "oracle+lru@0.5", "none+lru@0.25"]
    assert -1 <= agreement["spearman"] <= 1 and agreement["median_relative_error"] >= 0
    for budget, sim in (("0.5", first), ("0.25", quarter)):
        limit = simulator["bounds"][budget]
        assert limit["belady_hit_rate"] >= sim["hit_rate"]  # no policy on demand loads less than Belady
        assert limit["physical_limit_tokens_per_s"] >= limit["belady_simulated_tokens_per_s"] > 0


def test_a_run_that_is_not_exact_fails_the_bench_naming_it(tiny_moe_dir, text_corpus, tmp_path, monkeypatch):
    """A reference that the runs cannot match (every token id shifted by one): the bench writes
    its JSON marked incomplete and raises one error naming each run, instead of `exact: false`."""
    real = bench._reference

    def shifted(*args, **kwargs):
        ids, fingerprint = real(*args, **kwargs)
        return [[token + 1 for token in run] for run in ids], fingerprint

    monkeypatch.setattr(bench, "_reference", shifted)
    out = tmp_path / "bench.json"
    with pytest.raises(NotExactError, match=r"none\+lru@0\.5.*"):
        bench.bench_runtime(tiny_moe_dir("mixtral"), corpus_texts(text_corpus), predictors={"none": None},
                            runs=parse_runs("none:lru@0.5"), baselines=("all_resident",), new_tokens=3,
                            isolate=False, json_path=out)
    written = json.loads(out.read_text())
    assert not written["complete"] and [r["exact"] for r in written["runs"]] == [False]


def test_hybrid_run_mode_admits_and_stays_exact(tiny_moe_dir, text_corpus, tmp_path):
    """`+hybrid`: the run with HybriMoE's scheduler (on this CPU host, admission) computes misses
    where they live and counts them in its decode stats; the same spec without it computes none;
    both give the all-resident model's tokens, and a spec named twice runs twice."""
    model = tiny_moe_dir("mixtral")
    runs = parse_runs("sida:learned-belady@0.25,sida:learned-belady@0.25+hybrid,sida:learned-belady@0.25+hybrid")
    assert runs[1] == RunSpec("sida", "learned-belady", 0.25, ("hybrid",)) == runs[2]
    result = bench.bench_runtime(model, corpus_texts(text_corpus), runs=runs, new_tokens=8,
                                 predictors={"sida": str(random_sida(model, tmp_path, horizon=2))},
                                 baselines=("all_resident",), isolate=False)
    plain, *hybrid = result["runs"]
    assert [r["label"] for r in hybrid] == ["sida+learned-belady@0.25+hybrid"] * 2
    assert plain["options"]["hybrid_schedule"] is False and plain["stats"]["where_it_lives"] == 0
    for record in hybrid:
        assert record["options"]["hybrid_schedule"] is True and record["stats"]["where_it_lives"] > 0
    assert all(r["exact"] for r in result["runs"]) and result["complete"]
