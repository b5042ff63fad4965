import dataclasses
import json

import pytest
import torch

from predictor import (
    CorrelationTable,
    FrequencyPredictor,
    PredictorArtifactError,
    PredictorError,
    PredictorMeta,
    SiDAHash,
    SiDAPredictor,
    SiDASizes,
    TokenTablePredictor,
    load_predictor,
    save_predictor,
)
from predictor.artifact import artifact_paths
from prescient.errors import FingerprintMismatchError
from prescient.traces import load_trace


def sida_predictor(fingerprint) -> SiDAPredictor:
    torch.manual_seed(0)
    sizes = SiDASizes(compress_dim=8, hidden_dim=12, attn_window=4)
    hash_fn = SiDAHash.from_embedding(torch.randn(fingerprint.vocab_size, 16), fingerprint.n_moe_layers,
                                      fingerprint.n_experts, sizes)
    meta = PredictorMeta("sida", fingerprint, dataclasses.asdict(sizes), {"trace_dir": "somewhere"},
                         {"val/recall_at_k": 0.5})
    return SiDAPredictor(hash_fn, meta)


def test_sida_round_trip(tmp_path, tiny_fingerprint):
    pred = sida_predictor(tiny_fingerprint)
    meta_path = save_predictor(pred, tmp_path / "hash")
    assert meta_path == tmp_path / "hash.json" and (tmp_path / "hash.safetensors").exists()
    loaded = load_predictor(tmp_path / "hash.safetensors", fingerprint=tiny_fingerprint)
    assert isinstance(loaded, SiDAPredictor)
    assert loaded.meta == pred.meta
    ids = torch.randint(0, tiny_fingerprint.vocab_size, (2, 7))
    torch.testing.assert_close(loaded.predict(ids), pred.predict(ids))
    state = loaded.start(2)
    torch.testing.assert_close(loaded.step(state, ids[:, 0]), pred.predict(ids[:, :1])[:, 0], atol=1e-6, rtol=1e-5)
    assert not list(tmp_path.glob(".*.tmp")), "atomic writes leave no temporary files"


@pytest.mark.parametrize("build", [
    FrequencyPredictor.from_trace,
    TokenTablePredictor.from_trace,
    lambda trace: CorrelationTable.from_trace(trace, path_length=2),
])
def test_table_round_trip(tmp_path, synthetic_trace, build):
    pred = build(load_trace(synthetic_trace))
    save_predictor(pred, tmp_path / "table.json")
    loaded = load_predictor(tmp_path / "table")
    assert type(loaded) is type(pred) and loaded.meta == pred.meta
    ids = torch.randint(0, 40, (3, 5))
    torch.testing.assert_close(loaded.predict(ids), pred.predict(ids))


def test_fingerprint_mismatch_names_both_models(tmp_path, tiny_fingerprint):
    save_predictor(sida_predictor(tiny_fingerprint), tmp_path / "hash")
    other = dataclasses.replace(tiny_fingerprint, weights_hash="0123456789abcdef")
    with pytest.raises(FingerprintMismatchError) as info:
        load_predictor(tmp_path / "hash", fingerprint=other)
    assert tiny_fingerprint.weights_hash in str(info.value) and "0123456789abcdef" in str(info.value)


def test_missing_torn_or_unknown_artifacts_are_clear_errors(tmp_path, tiny_fingerprint):
    with pytest.raises(PredictorArtifactError, match="does not exist"):
        load_predictor(tmp_path / "nothing")
    save_predictor(sida_predictor(tiny_fingerprint), tmp_path / "hash")
    weights, meta_path = artifact_paths(tmp_path / "hash")
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(PredictorArtifactError, match="does not match"):
        load_predictor(tmp_path / "hash")
    data = json.loads(meta_path.read_text())
    data["kind"] = "crystal-ball"
    meta_path.write_text(json.dumps(data))
    with pytest.raises(PredictorError, match="unknown predictor kind 'crystal-ball'"):
        load_predictor(tmp_path / "hash")
