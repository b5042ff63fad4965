"""`prescient trace` on tiny random models of every supported MoE architecture.

The reference for each router choice is the plain transformers model run on the window
alone (no padding, no hooks) with `output_router_logits=True`: the trace must hold the
top-k of those logits (DeepSeek-V3: the group-limited, bias-corrected choice recomputed
from them, see `deepseek_choice`), in order, and the top-T logits.
"""

from __future__ import annotations

import pytest
import torch

from prescient.fingerprint import fingerprint_model
from prescient.traces import COLUMNS, load_trace
from training.corpora import load_corpus
from training.tracing import trace_model

TOP_T, SEQ_LEN, BATCH, MAX_TOKENS = 6, 24, 4, 1200
# (MoE layers, experts, top-k) of each tiny config in conftest
SHAPES = {
    "mixtral": (2, 8, 2), "qwen2_moe": (2, 4, 2), "qwen3_moe": (2, 8, 2), "olmoe": (2, 4, 2),
    "deepseek_v3": (2, 8, 2), "phimoe": (2, 4, 2), "granitemoe": (2, 4, 2), "switch_transformers": (4, 4, 1),
}
DTYPES = {"seq_id": torch.int64, "position": torch.int32, "token_id": torch.int64, "topk_ids": torch.int16,
          "topt_ids": torch.int16, "topt_logits": torch.float32}


@pytest.fixture(scope="module")
def traced(tiny_moe, text_corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"trace-{tiny_moe.arch}") / "trace"
    trace_model(tiny_moe.path, f"json:{text_corpus}", out, split="train", max_tokens=MAX_TOKENS, top_t=TOP_T,
                seq_len=SEQ_LEN, batch_size=BATCH, shard_sequences=8)
    return tiny_moe, load_trace(out), tiny_moe.load()


def test_schema_and_manifest(traced, text_corpus):
    tiny, trace, model = traced
    n_layers, n_experts, top_k = SHAPES[tiny.arch]
    n, t = len(trace), min(TOP_T, n_experts)
    shapes = {"seq_id": (n,), "position": (n,), "token_id": (n,), "topk_ids": (n, n_layers, top_k),
              "topt_ids": (n, n_layers, t), "topt_logits": (n, n_layers, t)}
    assert {k: (v.dtype, tuple(v.shape)) for k, v in trace.columns.items()} == {
        k: (DTYPES[k], shapes[k]) for k in COLUMNS}
    manifest = trace.manifest
    assert manifest.fingerprint == fingerprint_model(model)
    fp = manifest.fingerprint
    assert (fp.arch, fp.n_moe_layers, fp.n_experts, fp.top_k, fp.vocab_size) == (
        tiny.arch, n_layers, n_experts, top_k, model.config.vocab_size)
    assert (manifest.dataset, manifest.split, manifest.top_t, manifest.complete) == (
        f"json:{text_corpus}", "train", t, True)
    assert manifest.settings["seq_len"] == SEQ_LEN and len(manifest.shards) > 1
    assert sum(s["rows"] for s in manifest.shards) == n
    for column in ("topk_ids", "topt_ids"):
        ids = trace[column]
        assert ids.min() >= 0 and ids.max() < n_experts
        assert (ids.sort(dim=-1).values.diff(dim=-1) > 0).all(), f"{column} repeats an expert"
    assert (trace["topt_logits"].diff(dim=-1) <= 0).all(), "top-T logits are not best first"


def test_every_real_token_is_one_row_and_padding_none(traced, text_corpus, tiny_tokenizer):
    _, trace, _ = traced
    texts = load_corpus(f"json:{text_corpus}", "train")["text"]
    tokens = [t for text in texts for t in tiny_tokenizer(text, add_special_tokens=False)["input_ids"]]
    assert len(tokens) > MAX_TOKENS  # so the cap is exercised
    assert trace["token_id"].tolist() == tokens[:MAX_TOKENS]
    assert tiny_tokenizer.pad_token_id not in trace["token_id"].tolist()
    lengths = [len(rows) for rows in trace.sequences()]
    assert trace["seq_id"].unique().tolist() == list(range(len(lengths)))
    for rows in trace.sequences():
        assert trace["position"][rows].tolist() == list(range(len(rows))) and len(rows) <= SEQ_LEN
    # windows of different lengths shared a padded batch
    assert any(len(set(lengths[i : i + BATCH])) > 1 for i in range(0, len(lengths), BATCH))


def deepseek_choice(logits: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int, k: int) -> torch.Tensor:
    """DeepSeek-V3's choice: sigmoid score + correction bias, within the `topk_group` groups
    whose two best scores sum highest."""
    scores = logits.sigmoid() + bias
    groups = scores.unflatten(-1, (n_group, -1))
    best_groups = groups.topk(2, dim=-1).values.sum(-1).topk(topk_group, dim=-1).indices
    allowed = torch.zeros(groups.shape[:-1], dtype=torch.bool).scatter(-1, best_groups, True)
    return scores.masked_fill(~allowed.repeat_interleave(groups.shape[-1], dim=-1), float("-inf")).topk(k).indices


def plain_router_logits(model, tokens: torch.Tensor, pad_id: int) -> torch.Tensor:
    """[n, L, E] router logits of the plain model on one unpadded window."""
    ids = tokens.unsqueeze(0)
    if model.config.is_encoder_decoder:  # the decoder reads pad (its start token), then the window
        decoder_ids = torch.cat([torch.tensor([[pad_id]]), ids], dim=1)
        out = model(input_ids=ids, decoder_input_ids=decoder_ids, output_router_logits=True)
        decoder_rows = [r.reshape(len(tokens) + 1, -1)[1:] for r in out.decoder_router_logits]
        per_layer = [*out.encoder_router_logits, *decoder_rows]
    else:
        per_layer = model(input_ids=ids, output_router_logits=True).router_logits
    return torch.stack([r.reshape(len(tokens), -1) for r in per_layer], dim=1).float()


@torch.no_grad()
def test_choices_match_the_plain_model(traced, tiny_tokenizer):
    tiny, trace, model = traced
    logits = torch.cat([plain_router_logits(model, trace["token_id"][rows], tiny_tokenizer.pad_token_id)
                        for rows in trace.sequences()])
    k = trace.fingerprint.top_k
    if tiny.arch == "deepseek_v3":
        bias = torch.stack([layer.mlp.gate.e_score_correction_bias for layer in model.model.layers[1:]])
        choice = deepseek_choice(logits, bias, model.config.n_group, model.config.topk_group, k)
        assert not torch.equal(choice.sort(-1).values, logits.topk(k).indices.sort(-1).values), \
            "the groups and bias never mattered: the test config is too weak"
        expected = logits.gather(-1, choice).sort(-1, descending=True).values
    else:
        expected = logits.topk(k).values
    # Compared by the logits the ids point at: equal up to float noise unless ids differ.
    torch.testing.assert_close(logits.gather(-1, trace["topk_ids"].long()), expected, atol=1e-5, rtol=0)
    top = logits.topk(trace.manifest.top_t)
    torch.testing.assert_close(logits.gather(-1, trace["topt_ids"].long()), top.values, atol=1e-5, rtol=0)
    torch.testing.assert_close(trace["topt_logits"], top.values, atol=1e-5, rtol=1e-5)
