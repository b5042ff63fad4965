"""`prescient trace --budget/--memory`: the model runs through the offloading runtime, under a
budget that forces misses, and the trace is the one the whole model writes in the same dtype:
every column bit-equal, the same manifest, and resumable across the two ways of loading."""

from __future__ import annotations

import pytest
import torch

import training.tracing
from cli.main import main
from offload_runtime.engine.loader import load_offloaded
from prescient.traces import load_trace, read_manifest
from training.tracing import trace_model

ARGS = dict(split="train", max_tokens=400, top_t=4, seq_len=16, batch_size=4, shard_sequences=8)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def same_trace(a, b) -> None:
    assert a.columns.keys() == b.columns.keys()
    for column in a.columns:
        assert torch.equal(a[column], b[column]), column
    assert a.manifest.fingerprint == b.manifest.fingerprint and a.manifest.settings == b.manifest.settings


@pytest.fixture(scope="module")
def resident(tiny_moe_dir, text_corpus, tmp_path_factory):
    """dtype -> (model dir, dataset, the trace of the whole model loaded in that dtype)."""
    model, dataset = tiny_moe_dir("mixtral"), f"json:{text_corpus}"
    traces = {}
    for name, dtype in DTYPES.items():
        out = trace_model(model, dataset, tmp_path_factory.mktemp(f"resident-{name}") / "trace", dtype=dtype, **ARGS)
        traces[name] = load_trace(out)
    return model, dataset, traces


@pytest.mark.parametrize("dtype", DTYPES)
def test_trace_through_the_runtime_under_a_budget_is_bit_equal_to_the_whole_models(resident, tmp_path, dtype):
    model_dir, dataset, traces = resident
    model = load_offloaded(model_dir, None, budget="3slots", dtype=dtype)  # 2 layers x 8 experts, top-2
    with model.runtime as runtime:
        trace_model(model_dir, dataset, tmp_path / "trace", dtype=DTYPES[dtype], model=model, **ARGS)
        stats = runtime.stats()
    assert stats.misses > 0 and stats.evictions > 0  # it really ran offloaded
    same_trace(load_trace(tmp_path / "trace"), traces[dtype])
    assert traces[dtype].manifest.settings.get("dtype") == (None if dtype == "float32" else dtype)


def test_trace_of_the_memory_mapped_model_is_bit_equal_too(resident, tmp_path):
    """`--memory` where the page cache can hold the experts maps them from the checkpoint (in the
    checkpoint's dtype, float32 here)."""
    model_dir, dataset, traces = resident
    model = load_offloaded(model_dir, None, memory="8GiB", map_experts=True)
    with model.runtime:
        trace_model(model_dir, dataset, tmp_path / "trace", model=model, **ARGS)
    same_trace(load_trace(tmp_path / "trace"), traces["float32"])


def test_a_whole_models_trace_cut_short_resumes_through_the_runtime(resident, tmp_path, monkeypatch):
    model_dir, dataset, traces = resident
    out = tmp_path / "trace"
    real_inputs, calls = training.tracing.model_inputs, []

    def stop_in_the_second_shard(*args):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real_inputs(*args)

    with monkeypatch.context() as patch:
        patch.setattr(training.tracing, "model_inputs", stop_in_the_second_shard)
        with pytest.raises(KeyboardInterrupt):
            trace_model(model_dir, dataset, out, **ARGS)
    assert len(read_manifest(out).shards) == 1
    with load_offloaded(model_dir, None, budget="3slots") as model:
        trace_model(model_dir, dataset, out, model=model, **ARGS)
    same_trace(load_trace(out), traces["float32"])


def test_trace_command_with_a_budget(resident, tmp_path):
    model_dir, dataset, traces = resident
    main(["trace", "--model", str(model_dir), "--dataset", dataset, "--split", "train", "--max-tokens", "400",
          "--top-t", "4", "--seq-len", "16", "--batch-size", "4", "--budget", "25%", "--out", str(tmp_path)])
    trace = load_trace(tmp_path)  # one shard of 256 windows, the same batches: the same rows
    assert all(torch.equal(trace[column], traces["float32"][column]) for column in trace.columns)


def test_a_run_without_a_predictor_drops_the_tuned_settings_that_need_one():
    """`prescient tune` measured with a predictor; `trace --memory` (no predictor) takes the rest."""
    from offload_runtime.engine.resolve import _without_forecasts

    tuned = {"policy": "learned-belady", "next_token_min_chance": 0.5, "transfer_workers": 2, "expert_pipeline": True}
    assert _without_forecasts(tuned) == {"transfer_workers": 2, "expert_pipeline": True}
    assert _without_forecasts({"policy": "lru", "next_token_min_chance": None}) == {"policy": "lru",
                                                                                   "next_token_min_chance": None}


def test_trace_command_under_a_memory_cap_cuts_the_batch_to_the_reserve_and_traces_the_same_rows(
        resident, tmp_path, caplog):
    """`--memory`'s plan reserves activations for a 512-token prefill: 64 windows of 16 tokens (1 024)
    go through in forwards of 32, and the trace is still the whole model's."""
    model_dir, dataset, traces = resident
    with caplog.at_level("INFO", logger="cli.trace"):
        main(["trace", "--model", str(model_dir), "--dataset", dataset, "--split", "train", "--max-tokens", "400",
              "--top-t", "4", "--seq-len", "16", "--batch-size", "64", "--memory", "8GiB", "--out", str(tmp_path)])
    assert "32 windows of 16 tokens per forward (not --batch-size 64)" in caplog.text
    trace = load_trace(tmp_path)  # the command's shards are 256 windows: the same rows, other shards
    assert trace.columns.keys() == traces["float32"].columns.keys()
    assert all(torch.equal(trace[column], traces["float32"][column]) for column in trace.columns)


def test_trace_command_by_default_traces_the_same_rows_with_and_without_memory(tiny_moe_dir, text_corpus, tmp_path):
    """By default both ways run the windows per forward that `--memory`'s reserve holds: on the tiny
    DeepSeek-V3, 11 windows of 128 tokens in one forward against 4 moved 92 of 8 000 router logits by
    up to 3e-8 (the expert ids were equal), so a default that differed made the traces differ."""
    model = str(tiny_moe_dir("deepseek_v3"))
    args = ["trace", "--model", model, "--dataset", f"json:{text_corpus}", "--split", "train", "--max-tokens", "1000",
            "--top-t", "4", "--hidden-states"]
    main([*args, "--out", str(tmp_path / "whole")])
    main([*args, "--memory", "8GiB", "--out", str(tmp_path / "capped")])
    whole, capped = (load_trace(tmp_path / name, hidden=True) for name in ("whole", "capped"))
    assert whole.manifest.n_tokens == 1000 and "hidden" in whole.columns
    same_trace(capped, whole)
