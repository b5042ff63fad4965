"""Random damage to trace shards and predictor files (hypothesis): loading either refuses it with
the project's own error, naming the file (and for a trace value the column), or loads data that
passes every check; never another exception, never a crash."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from predictor import SiDAPredictor, SiDASizes
from predictor.artifact import PredictorArtifactError, load_predictor, save_predictor
from predictor.base import PredictorMeta
from predictor.sida import SiDAHash, read_token_embeddings
from prescient.errors import PrescientError, TraceError
from prescient.fingerprint import fingerprint_model_dir
from prescient.traces import COLUMNS, load_trace
from training.tracing import trace_model

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory, tiny_moe_dir, text_corpus) -> Path:
    return trace_model(tiny_moe_dir("mixtral"), f"json:{text_corpus}", tmp_path_factory.mktemp("trace") / "t",
                       split="train", max_tokens=48, top_t=4, seq_len=16, batch_size=4, shard_sequences=2)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, tiny_moe_dir) -> Path:
    model = tiny_moe_dir("mixtral")
    fingerprint = fingerprint_model_dir(model)
    sizes = SiDASizes(compress_dim=8, hidden_dim=16, attn_window=8)
    hash_fn = SiDAHash.from_embedding(read_token_embeddings(model), fingerprint.n_moe_layers,
                                      fingerprint.n_experts, sizes)
    meta = PredictorMeta("sida", fingerprint, dataclasses.asdict(sizes))
    return save_predictor(SiDAPredictor(hash_fn, meta), tmp_path_factory.mktemp("artifact") / "sida").with_suffix("")


def copy_of(source: Path) -> Path:
    target = Path(tempfile.mkdtemp(prefix="damaged-")) / source.name
    shutil.copytree(source, target)
    return target


def flip(path: Path, damage: list[tuple[int, int]]) -> None:
    data = bytearray(path.read_bytes())
    for position, value in damage:
        data[position % len(data)] = value
    path.write_bytes(bytes(data))


byte_damage = st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), min_size=1, max_size=8)


@FAST
@given(damage=byte_damage, target=st.sampled_from(["shard", "manifest"]))
def test_damaged_trace_bytes_are_refused_or_harmless(trace_dir, damage, target):
    trace = copy_of(trace_dir)
    path = trace / ("shard-00000.safetensors" if target == "shard" else "manifest.json")
    before = path.read_bytes()
    flip(path, damage)
    try:
        loaded = load_trace(trace)
    except TraceError as exc:
        assert str(trace) in str(exc)
    else:  # only a change that alters nothing a reader uses loads: never a shard byte (its SHA-256)
        assert target == "manifest" or path.read_bytes() == before
        assert len(loaded) == len(load_trace(trace_dir))
    finally:
        shutil.rmtree(trace.parent)


def legal(column: str, value: float, n_experts: int, vocab: int) -> bool:
    if column == "topt_logits":
        return bool(torch.isfinite(torch.tensor(value)))
    high = {"topk_ids": n_experts, "topt_ids": n_experts, "token_id": vocab}.get(column)
    return value >= 0 and (high is None or value < high)


values = st.one_of(st.integers(-(1 << 15), (1 << 15) - 1), st.sampled_from([float("nan"), float("inf"), -1e30]))


@FAST
@given(column=st.sampled_from([c for c in COLUMNS if c not in ("seq_id", "position")]), row=st.integers(0, 10**6),
       value=values)
def test_damaged_trace_values_name_the_shard_and_column(trace_dir, column, row, value):
    """A value written into a shard whose SHA-256 was updated too (a buggy writer): refused,
    naming the shard and the column, exactly when it is out of range or not finite."""
    trace = copy_of(trace_dir)
    try:
        shard = trace / "shard-00000.safetensors"
        data = load_file(str(shard))
        flat = data[column].view(-1)
        if not data[column].is_floating_point() and not isinstance(value, int):
            value = -1  # an integer column cannot hold nan: its nearest damage is a negative id
        flat[row % len(flat)] = value
        value = flat[row % len(flat)].item()  # what the dtype made of it
        save_file(data, str(shard))
        manifest = json.loads((trace / "manifest.json").read_text())
        manifest["shards"][0]["sha256"] = hashlib.sha256(shard.read_bytes()).hexdigest()
        (trace / "manifest.json").write_text(json.dumps(manifest))
        fp = manifest["fingerprint"]
        if legal(column, value, fp["n_experts"], fp["vocab_size"]):
            assert len(load_trace(trace)) == manifest["n_tokens"]
        else:
            with pytest.raises(TraceError, match=f"{shard}: column {column} holds"):
                load_trace(trace)
    finally:
        shutil.rmtree(trace.parent)


@FAST
@given(damage=byte_damage)
def test_damaged_predictor_tensors_are_refused(artifact, damage):
    folder = copy_of(artifact.parent)
    try:
        weights = folder / "sida.safetensors"
        before = weights.read_bytes()
        flip(weights, damage)
        if weights.read_bytes() == before:
            load_predictor(folder / "sida")
        else:
            with pytest.raises(PredictorArtifactError, match="sida.safetensors"):
                load_predictor(folder / "sida")
    finally:
        shutil.rmtree(folder.parent)


json_values = st.recursive(st.none() | st.booleans() | st.integers(-3, 1 << 40) | st.floats() | st.text(max_size=5),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                        max_size=3),
                           max_leaves=6)


def json_paths(data: object, prefix: tuple = ()) -> list[tuple]:
    """Every key path into nested dicts."""
    if not isinstance(data, dict):
        return []
    return [p for key, value in data.items() for p in [(*prefix, key), *json_paths(value, (*prefix, key))]]


@FAST
@given(choice=st.integers(0, 10**6), value=json_values, delete=st.booleans())
def test_damaged_predictor_json_is_refused_or_loads(artifact, choice, value, delete):
    """Any field of the JSON replaced by any JSON value, or deleted: it loads, or the error is one
    of ours (never a KeyError or TypeError from deep inside)."""
    folder = copy_of(artifact.parent)
    try:
        meta_path = folder / "sida.json"
        meta = json.loads(meta_path.read_text())
        paths = json_paths(meta)
        *parents, key = paths[choice % len(paths)]
        node = meta
        for parent in parents:
            node = node[parent]
        if delete:
            del node[key]
        else:
            node[key] = value
        meta_path.write_text(json.dumps(meta))
        try:
            load_predictor(folder / "sida")
        except PrescientError as exc:
            assert "sida" in str(exc)
    finally:
        shutil.rmtree(folder.parent)


def test_a_manifest_without_its_format_is_refused_naming_the_file(tmp_path):
    """A damaged `format` field (found by the byte-damage property test) names the manifest too."""
    from prescient.traces import TraceError, load_trace

    trace = tmp_path / "t"
    trace.mkdir()
    (trace / "manifest.json").write_text(json.dumps({"shards": []}))
    with pytest.raises(TraceError, match="unknown trace format") as refused:
        load_trace(trace)
    assert str(trace) in str(refused.value)
