"""`prescient bench-batch` on a tiny random 4-layer Mixtral: every decode exact, the JSON holds
what the issue asks for, the rank correlation is computed right. Real checkpoints, threads,
files and a measured hardware profile."""

from __future__ import annotations

import json

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


def test_bench_batch_end_to_end(tmp_path, tiny_tokenizer):
    model = save_tiny_model(tiny_test_config("mixtral", tiny_tokenizer, num_hidden_layers=4), tmp_path / "model",
                            tokenizer=tiny_tokenizer)
    out = tmp_path / "bench-batch.json"
    main = BatchPolicy(4, 2, 0.25)
    grid = [main, BatchPolicy(2, 1, 0.5), BatchPolicy(4, 4, 0.75)]
    result = bench_batch(str(model), str(out), str(tmp_path / "bench-batch.png"), main, grid,
                         sequential_at=[BatchPolicy(2, 1, 0.5)], gen_len=3, shortest=3, longest=6,
                         hardware=None, trace=None)
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["all_exact"] and result["grid_size"] == 3
    modes = [(r["label"], r["mode"]) for r in result["runs"]]
    assert modes.count((main.label, "sequential")) == 1 and len(modes) == 3 + 2
    for key in ("cgopipe_tokens_per_s", "sequential_tokens_per_s", "resident_tokens_per_s"):
        assert result[key] > 0
    assert -1 <= result["spearman"] <= 1 and 0 <= result["planner_gap"] < 1
    assert result["hardware_profile"]["gpu"] is None and result["hardware_profile"]["disk_to_cpu"] > 0
    assert (tmp_path / "bench-batch.png").stat().st_size > 0
