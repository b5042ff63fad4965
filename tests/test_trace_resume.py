"""An interrupted `prescient trace` leaves only complete shards and resumes to the same rows."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import training.tracing
from prescient.errors import TraceError
from prescient.traces import COLUMNS, load_trace, read_manifest
from training.tracing import trace_model

# 8 windows per shard, 2 batches per shard; the corpus gives 4 or more shards
ARGS = dict(split="train", max_tokens=500, top_t=4, seq_len=16, batch_size=4, shard_sequences=8)
FIRST, SECOND = "shard-00000.safetensors", "shard-00001.safetensors"


@pytest.fixture(scope="module")
def reference(tiny_moe_dir, text_corpus, tmp_path_factory):
    """(model dir, dataset spec, the uninterrupted trace)."""
    model, dataset = tiny_moe_dir("mixtral"), f"json:{text_corpus}"
    out = trace_model(model, dataset, tmp_path_factory.mktemp("reference") / "trace", **ARGS)
    return model, dataset, load_trace(out)


def interrupt(monkeypatch, where: str) -> None:
    """Raise KeyboardInterrupt once the first shard is safely listed, at `where`:
    forward   inside the second shard's second forward (its first batch is done, in memory)
    rename    after the second shard's temporary file is written, before its rename
    manifest  after the second shard is renamed, before the manifest lists it"""
    if where == "forward":
        real_inputs, calls = training.tracing.model_inputs, []

        def model_inputs(*args):
            calls.append(1)
            if len(calls) == 4:
                raise KeyboardInterrupt
            return real_inputs(*args)

        monkeypatch.setattr(training.tracing, "model_inputs", model_inputs)
        return
    real_replace = os.replace

    def replace(src, dst):
        if Path(dst).name == (SECOND if where == "rename" else "manifest.json") and (
                where == "rename" or (Path(dst).parent / SECOND).exists()):
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)


@pytest.mark.parametrize("where", ["forward", "rename", "manifest"])
def test_interrupted_trace_resumes_to_the_rows_of_an_uninterrupted_run(reference, tmp_path, monkeypatch, where):
    model, dataset, expected = reference
    out = tmp_path / "trace"
    with monkeypatch.context() as patch:
        interrupt(patch, where)
        with pytest.raises(KeyboardInterrupt):
            trace_model(model, dataset, out, **ARGS)

    manifest = read_manifest(out)
    assert not manifest.complete and [s["file"] for s in manifest.shards] == [FIRST]
    # No temporary is left, and no half-written shard sits under a real name; after a kill
    # between rename and manifest update, the unlisted second shard is complete.
    left = {"manifest.json", FIRST} | ({SECOND} if where == "manifest" else set())
    assert {p.name for p in out.iterdir()} == left
    if where == "manifest":
        assert len(load_trace(out, require_complete=False)) == manifest.shards[0]["rows"]
    with pytest.raises(TraceError, match="incomplete.*run the same `prescient trace` again"):
        load_trace(out)
    first_shard = (out / FIRST).stat().st_mtime_ns
    (out / f".{SECOND}.killed.tmp").write_bytes(b"what a killed process leaves behind")

    trace_model(model, dataset, out, **ARGS)
    resumed = load_trace(out)
    assert (out / FIRST).stat().st_mtime_ns == first_shard  # resumed, not started over
    assert resumed.manifest.shards == expected.manifest.shards and len(expected.manifest.shards) >= 4
    for column in COLUMNS:
        assert torch.equal(resumed[column], expected[column]), column
    assert not list(out.glob(".*"))


def test_a_complete_trace_is_not_traced_again(reference, tmp_path):
    model, dataset, expected = reference
    out = trace_model(model, dataset, tmp_path / "trace", **{**ARGS, "max_tokens": 40})
    stamp = (out / "manifest.json").stat().st_mtime_ns
    trace_model(model, dataset, out, **{**ARGS, "max_tokens": 40})
    assert (out / "manifest.json").stat().st_mtime_ns == stamp
    assert torch.equal(load_trace(out)["topk_ids"], expected["topk_ids"][:40])


def test_resume_takes_the_same_model_under_another_path(reference, tmp_path, monkeypatch):
    """The model is compared by fingerprint and recorded by absolute path, not as spelled."""
    model, dataset, expected = reference
    out = tmp_path / "trace"
    with monkeypatch.context() as patch:
        interrupt(patch, "forward")
        patch.chdir(model.parent)
        with pytest.raises(KeyboardInterrupt):
            trace_model(Path(model.name), dataset, out, **ARGS)
    assert read_manifest(out).settings["model"] == str(model.resolve())
    trace_model(model / ".." / model.name, dataset, out, **ARGS)
    assert torch.equal(load_trace(out)["topk_ids"], expected["topk_ids"])
