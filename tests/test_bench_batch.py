"""`prescient bench-batch` on a tiny random 4-layer Mixtral: every decode exact, the JSON holds
what the issue asks for, the rank correlation is computed right. Real checkpoints, threads,
files and a measured hardware profile."""

from __future__ import annotations

import json
import logging

import pytest

from experiments.bench_batch import BatchPolicy, BenchBatchError, bench_batch, parse_grid, spearman
from prescient.arch_zoo import save_tiny_model
from tests.conftest import tiny_test_config


def test_spearman_ranks_with_ties():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ties share their mean rank: [1, 2.5, 2.5, 4] against [1, 2, 3, 4]
    assert spearman([5, 7, 7, 9], [1, 2, 3, 4]) == pytest.approx(0.9486833, abs=1e-6)


def test_grid_parsing():
    assert parse_grid("8:4:0.5, 16:8:0.25") == [BatchPolicy(8, 4, 0.5), BatchPolicy(16, 8, 0.25)]
    with pytest.raises(BenchBatchError, match="N:MICRO_BATCH:RESIDENT"):
        parse_grid("8:4")


@pytest.mark.slow  # 20-45 s: the default suite must stay under 10 minutes on 2 cores
def test_bench_batch_end_to_end(tmp_path, tiny_tokenizer):
    model = save_tiny_model(tiny_test_config("mixtral", tiny_tokenizer, num_hidden_layers=4), tmp_path / "model",
                            tokenizer=tiny_tokenizer)
    out = tmp_path / "bench-batch.json"
    main = BatchPolicy(4, 2, 0.25)
    grid = [main, BatchPolicy(4, 4, 0.75)]
    result = bench_batch(str(model), str(out), str(tmp_path / "bench-batch.png"), [main], grid,
                         sequential_at=[main], gen_len=3, shortest=3, longest=6, hardware=None, trace=None,
                         repeats=2, sweep=(1, 0.5, [1, 2]))
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["all_exact"]
    compared = [(r["label"], r["mode"], r["repeat"]) for r in result["runs"] if r["part"] == "compared"]
    modes = ("klotski", "klotski-paper", "cgopipe", "zigzag", "sequential", "accelerate")
    assert compared == [(main.label, mode, repeat) for repeat in (0, 1) for mode in modes]  # interleaved: A B C A B C
    row = result["by_policy"][main.label]
    assert set(row["modes"]) == set(modes)
    for stats in row["modes"].values():
        assert stats["tokens_per_s"]["n"] == 2 and stats["tokens_per_s"]["min"] <= stats["tokens_per_s"]["median"]
        assert stats["bytes_per_token"]["median"] > 0
        # the HRM's prediction for the schedule beside its measurement
        assert stats["predicted_tokens_per_s"] > 0 and stats["predicted_decode_tokens_per_s"] > 0
        assert stats["prediction_over_measured"]["tokens_per_s"] == pytest.approx(
            stats["predicted_tokens_per_s"] / stats["tokens_per_s"]["median"])
    for run in result["runs"]:
        assert run["part"] == "sweep" or run["predicted_tokens_per_s"] > 0
    assert 0 < row["modes"]["klotski"]["activated_share"] <= 1 and row["klotski_over_cgopipe"] > 0
    assert row["cgopipe_over_accelerate"] > 0 and result["hrm_schedules"]["pairs"] == len(modes)
    accelerate = [r for r in result["runs"] if r["mode"] == "accelerate"]
    assert result["settings"]["accelerate"]["runs"] == "repeats" and all(r["exact"] for r in accelerate)
    assert all(0 <= r["resident_expert_share"] <= 1 and r["resident_weight_bytes"] <= r["budget_bytes"]
               for r in accelerate)
    sweep = result["klotski_sweep"]
    assert sweep["planner_group_size"] in (1, 2) and 0 <= sweep["planner_gap"] < 1
    assert result["klotski_times"]["io_expert"] > 0 and result["klotski_plan"]["hot_count"] >= 0
    assert result["hrm"]["grid_size"] == 2 and -1 <= result["hrm"]["spearman"] <= 1
    assert result["hardware_profile"]["gpu"] is None and result["hardware_profile"]["disk_to_cpu"] > 0
    assert (tmp_path / "bench-batch.png").stat().st_size > 0


def test_accelerate_budget_is_the_other_schedules_weights(tmp_path, tiny_moe_dir):
    """accelerate gets the bytes the slot pool and the non-expert weights take, and keeps whole
    decoder layers under it; each run is exact against the requests generated alone."""
    import torch

    from experiments.bench_batch_accelerate import measure_accelerate, weight_budget_bytes
    from experiments.bench_batch_resident import reference_outputs
    from offload_runtime.planning.hrm import ModelSpec
    from prescient.loading import load_model

    path = tiny_moe_dir("mixtral")  # 8 experts
    spec = ModelSpec.from_config(path)
    # r_w = 0.5: 4 resident experts in every layer + 2 layers' 4 streamed ones
    assert weight_budget_bytes(spec, 0.5) == spec.non_expert_bytes + (4 * spec.num_layers + 8) * spec.expert_bytes
    plain, _ = load_model(str(path), dtype=torch.float32)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    reference = reference_outputs(plain, prompts, 3)
    run = measure_accelerate(str(path), prompts, 3, 0.25, reference, spec)
    assert run["exact"] and run["resident_weight_bytes"] <= run["budget_bytes"] == weight_budget_bytes(spec, 0.25)
    # the budget leaves modules on disk (here the LM head: the tiny model's embeddings outweigh its experts)
    assert run["offloaded_bytes_per_pass"] > 0 and run["disk_modules"]
    assert run["resident_weight_bytes"] + run["offloaded_bytes_per_pass"] == sum(
        p.numel() * p.element_size() for p in plain.parameters())
    assert run["bytes_per_token"] == pytest.approx(run["offloaded_bytes_per_pass"] * 3 / 6)
    assert run["read_bytes_per_token"] >= 0 and 0 <= run["resident_expert_share"] <= 1


def _other_models_table(path, tiny_moe_dir):
    """A klotski-correlation artifact of a model with 4 experts, not the 8 of tiny mixtral."""
    import torch

    from predictor.artifact import save_predictor
    from predictor.base import PredictorMeta
    from predictor.correlation import CorrelationTable
    from prescient.fingerprint import ModelFingerprint

    fp = ModelFingerprint("mixtral", 4, 4, 2, 50, "0" * 16)
    table = CorrelationTable([torch.zeros(3, 4, 4)], torch.zeros(50, 1, 4), PredictorMeta("klotski-correlation", fp,
                                                                                          {"path_length": 1}))
    save_predictor(table, path)
    return path


def test_bad_group_size_and_hot_count_are_one_error_line(tmp_path, tiny_moe_dir, capsys, caplog):
    from cli.main import main as prescient

    path = tiny_moe_dir("mixtral")  # 8 experts: at r_w = 0.5, 4 stream
    other = _other_models_table(tmp_path / "other-corr", tiny_moe_dir)
    for argv, message in ((["--sweep-groups", "0,2"], "group sizes are whole numbers of at least 1"),
                          (["--policy", "6:4:0.5"], "N must be a multiple of the micro-batch size"),
                          (["--hot-count", "5", "--compare", "none", "--grid", "none"], "K=5 hot experts"),
                          (["--sweep-groups", "1,100000"], "group size"),
                          (["--correlation", str(other), "--compare", "none", "--grid", "none"], "another model"),
                          (["--accelerate", "sometimes"], "--accelerate")):
        capsys.readouterr()
        caplog.clear()
        with caplog.at_level(logging.INFO), pytest.raises(SystemExit) as exit_:
            prescient(["bench-batch", "--model", str(path), "--json", str(tmp_path / "out.json"), *argv])
        logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        lines = [line for line in capsys.readouterr().err.splitlines() + logged if line.startswith("error:")]
        assert exit_.value.code == 2 and len(lines) == 1 and message in lines[0]
        assert not (tmp_path / "out.json").exists()
