import dataclasses

import pytest
import torch

from prescient.errors import FingerprintMismatchError, TraceError
from prescient.traces import load_trace
from training.predictor_data import PredictorDataModule


def test_windows_cover_every_token_once_with_padding_masked(synthetic_trace):
    data = PredictorDataModule(str(synthetic_trace), window=10, val_fraction=0.25)
    data.setup("fit")
    trace = load_trace(synthetic_trace)
    seen = 0
    for windows in (data.train_set, data.val_set):
        for i in range(len(windows)):
            item = windows[i]
            start, n = windows.spans[i]
            assert item["mask"].sum() == n and not item["mask"][n:].any()
            assert torch.equal(item["token_ids"][:n], trace["token_id"][start:start + n])
            assert torch.equal(item["topk_ids"][:n], trace["topk_ids"][start:start + n].long())
            assert item["topt_logits"].shape == (10, 3, 6)
            seen += n
    assert seen == len(trace)  # 24-token sequences → windows of 10, 10, 4


def test_the_held_out_split_is_deterministic_and_disjoint(synthetic_trace):
    def val_starts(seed):
        data = PredictorDataModule(str(synthetic_trace), val_fraction=0.25, split_seed=seed)
        data.setup("fit")
        return {s for s, _ in data.val_set.spans}, {s for s, _ in data.train_set.spans}

    val, train = val_starts(0)
    assert val_starts(0) == (val, train) and not val & train
    assert len(val) == 12  # a quarter of 48 sequences
    assert val_starts(1)[0] != val


def test_validation_trace_must_come_from_the_same_model(tmp_path, synthetic_trace, make_synthetic_trace,
                                                        tiny_fingerprint):
    other = dataclasses.replace(tiny_fingerprint, weights_hash="feedfacefeedface")
    val = make_synthetic_trace(tmp_path / "other", n_seqs=4, fingerprint=other)
    data = PredictorDataModule(str(synthetic_trace), val_trace_dir=str(val))
    with pytest.raises(FingerprintMismatchError, match="feedfacefeedface"):
        data.setup("fit")


def test_a_single_sequence_cannot_be_split(tmp_path, make_synthetic_trace):
    trace = make_synthetic_trace(tmp_path / "one", n_seqs=1)
    with pytest.raises(TraceError, match="at least 2"):
        PredictorDataModule(str(trace)).setup("fit")
