"""`prescient trace --decode-tokens`: a prompt from each window and the model's own greedy
continuation, routed as when the model decodes it (`training.tracing`'s decode trace)."""

from __future__ import annotations

import pytest
import torch

from offload_runtime.engine.loader import load_offloaded
from prescient.errors import TraceError
from prescient.traces import TraceManifest, TraceWriter, load_trace
from training.tracing import trace_model, trace_windows

PROMPT, DECODE, SEQ_LEN = 6, 10, 24


@pytest.fixture(scope="module")
def decode_trace(tiny_moe_dir, text_corpus, tmp_path_factory):
    path = tiny_moe_dir("mixtral")
    out = tmp_path_factory.mktemp("decode") / "trace"
    trace_model(path, f"json:{text_corpus}", out, split="train", max_tokens=5 * (PROMPT + DECODE), top_t=4,
                seq_len=SEQ_LEN, batch_size=2, shard_sequences=2, decode_tokens=DECODE, prompt_tokens=PROMPT)
    return path, load_trace(out)


def test_each_sequence_is_a_prompt_and_the_models_greedy_continuation(decode_trace):
    from prescient.model_dir import ModelDirectory, model_class

    path, trace = decode_trace
    directory = ModelDirectory.open(path)
    model = model_class(directory.config).from_pretrained(path).eval()
    eos = directory.tokenizer().eos_token_id
    seq, tokens = trace["seq_id"], trace["token_id"]
    assert trace.manifest.settings["decode_tokens"] == DECODE and trace.manifest.settings["prompt_tokens"] == PROMPT
    assert seq.unique().numel() == 5  # max_tokens // (prompt + decode) prompts
    for sequence in seq.unique():
        ids = tokens[seq == sequence]
        assert PROMPT < len(ids) <= PROMPT + DECODE
        alone = model.generate(ids[None, :PROMPT], attention_mask=torch.ones(1, PROMPT, dtype=torch.long),
                               max_new_tokens=DECODE, do_sample=False, pad_token_id=eos, eos_token_id=eos)[0]
        assert ids.tolist() == alone[: len(ids)].tolist()  # its own greedy tokens, batched or alone
        if len(ids) < PROMPT + DECODE:  # cut short only after an end of sequence
            assert ids[-1].item() == eos


def test_the_routing_is_an_ordinary_trace_of_the_same_sequences(decode_trace, tmp_path):
    """The continuations are generated while the routers' hooks record: what the trace keeps must
    still be the forward over the whole sequence, not a generation step's."""
    from prescient.arch import find_moe_layers
    from prescient.model_dir import ModelDirectory, model_class

    path, trace = decode_trace
    model = model_class(ModelDirectory.open(path).config).from_pretrained(path).eval()
    seq = trace["seq_id"]
    sequences = [trace["token_id"][seq == s].tolist() for s in seq.unique()]
    writer = TraceWriter(tmp_path / "plain", TraceManifest(fingerprint=trace.manifest.fingerprint, dataset="same",
                                                           split="train", top_t=trace.manifest.top_t, settings={}))
    trace_windows(model, find_moe_layers(model), sequences, writer, pad_id=0, top_t=trace.manifest.top_t,
                  batch_size=2, shard_sequences=len(sequences))
    writer.finish()
    plain = load_trace(tmp_path / "plain")
    for column in ("token_id", "topk_ids", "topt_ids", "topt_logits"):
        assert torch.equal(plain[column], trace[column]), column


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_trace_through_the_runtime_is_the_whole_models(tiny_moe_dir, text_corpus, tmp_path, dtype):
    """Under a budget of 3 slots (a layer routes a token to 2 of 8 experts, a window to more): the same
    continuations and routing as the whole model's, in each dtype."""
    path = tiny_moe_dir("mixtral")
    args = dict(split="train", max_tokens=4 * (PROMPT + DECODE), top_t=4, seq_len=SEQ_LEN, batch_size=2,
                shard_sequences=2, decode_tokens=DECODE, prompt_tokens=PROMPT, dtype=dtype)
    whole = load_trace(trace_model(path, f"json:{text_corpus}", tmp_path / "whole", **args))
    model = load_offloaded(path, None, budget="3slots", dtype=str(dtype).removeprefix("torch."))
    with model.runtime as runtime:
        trace_model(path, f"json:{text_corpus}", tmp_path / "offloaded", model=model, **args)
        assert runtime.stats().misses > 0
    offloaded = load_trace(tmp_path / "offloaded")
    for column in whole.columns:
        assert torch.equal(offloaded[column], whole[column]), column


def test_resuming_with_other_decode_settings_is_refused(decode_trace, text_corpus, tmp_path):
    path, trace = decode_trace
    out = tmp_path / "trace"
    args = dict(split="train", max_tokens=2 * (PROMPT + DECODE), top_t=4, seq_len=SEQ_LEN, batch_size=2,
                shard_sequences=1, prompt_tokens=PROMPT)
    trace_model(path, f"json:{text_corpus}", out, decode_tokens=DECODE, **args)
    with pytest.raises(TraceError, match="decode_tokens"):
        trace_model(path, f"json:{text_corpus}", out, decode_tokens=DECODE + 1, **args)


def test_an_encoder_decoder_is_refused(tiny_moe_dir, text_corpus, tmp_path):
    with pytest.raises(TraceError, match="decoder-only"):
        trace_model(tiny_moe_dir("switch_transformers"), f"json:{text_corpus}", tmp_path / "t", split="train",
                    max_tokens=64, decode_tokens=4)
