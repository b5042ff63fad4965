"""`prescient trace --hidden-states`: each MoE layer's block input as an extra column, said so in
the manifest, resumable like any trace; a trace without it is unchanged and refused by the probe."""

from __future__ import annotations

import json

import pytest
import torch

import training.tracing
from cli.main import main as prescient
from prescient.arch import find_moe_layers
from prescient.errors import TraceError
from prescient.loading import load_model
from prescient.traces import COLUMNS, MissingHiddenStatesError, load_trace, read_manifest
from training.tracing import trace_model

ARGS = dict(split="train", max_tokens=300, top_t=8, seq_len=16, batch_size=4, shard_sequences=4)


@pytest.fixture(scope="module")
def traced(tiny_moe_dir, text_corpus, tmp_path_factory):
    """(model dir, dataset, the hidden-state trace made through the command line)."""
    model, dataset = tiny_moe_dir("mixtral"), f"json:{text_corpus}"
    out = tmp_path_factory.mktemp("hidden") / "trace"
    prescient(["trace", "--model", str(model), "--dataset", dataset, "--split", "train", "--max-tokens", "300",
               "--top-t", "8", "--seq-len", "16", "--batch-size", "4", "--hidden-states", "--out", str(out)])
    return model, dataset, out


def test_the_column_holds_what_each_router_reads(traced):
    model_dir, _, out = traced
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["hidden_states"] == {"column": "hidden", "dtype": "bfloat16", "size": 32}
    trace = load_trace(out, hidden=True)
    assert set(trace.columns) == {*COLUMNS, "hidden"} and trace["hidden"].dtype == torch.bfloat16
    assert trace["hidden"].shape == (len(trace), 2, 32)
    assert "hidden" not in load_trace(out).columns  # read only when asked
    model, _ = load_model(model_dir, dtype=torch.float32)
    for i, layer in enumerate(find_moe_layers(model)):
        logits, _ = layer.adapter.routing(layer, layer.router(trace["hidden"][:, i].float()))  # on the rounded input
        torch.testing.assert_close(logits.gather(-1, trace["topt_ids"][:, i].long()), trace["topt_logits"][:, i],
                                   atol=0.05, rtol=0.05)


def test_a_plain_trace_is_unchanged_and_refused_for_hidden_states(traced, tmp_path):
    model_dir, dataset, _ = traced
    out = trace_model(model_dir, dataset, tmp_path / "plain", **{**ARGS, "max_tokens": 40})
    assert "hidden_states" not in json.loads((out / "manifest.json").read_text())
    with pytest.raises(MissingHiddenStatesError, match=f"trace {out} holds no hidden states; trace it again with "
                                                       r"`prescient trace \.\.\. --hidden-states`"):
        load_trace(out, hidden=True)
    with pytest.raises(TraceError, match=r"other settings \(hidden_states: None there, 32 now\)"):
        trace_model(model_dir, dataset, out, **{**ARGS, "max_tokens": 40}, hidden_states=True)


def test_an_interrupted_hidden_state_trace_resumes_to_the_same_rows(traced, tmp_path, monkeypatch):
    model_dir, dataset, reference = traced
    expected = load_trace(reference, hidden=True)
    out = tmp_path / "trace"
    calls = []
    real = training.tracing.model_inputs

    def model_inputs(*args):
        calls.append(1)
        if len(calls) == 2:  # the second shard's forward (one batch a shard)
            raise KeyboardInterrupt
        return real(*args)

    with monkeypatch.context() as patch:
        patch.setattr(training.tracing, "model_inputs", model_inputs)
        with pytest.raises(KeyboardInterrupt):
            trace_model(model_dir, dataset, out, **ARGS, hidden_states=True)
    assert len(read_manifest(out).shards) == 1
    trace_model(model_dir, dataset, out, **ARGS, hidden_states=True)
    resumed = load_trace(out, hidden=True)
    for column in (*COLUMNS, "hidden"):
        assert torch.equal(resumed[column], expected[column]), column
