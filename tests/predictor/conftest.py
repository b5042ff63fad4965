"""Fixtures for predictor tests: a tiny random Mixtral saved as an HF model dir, and traces
written with the real `TraceWriter` (hand-made or synthetic with learnable routing)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM

from prescient.fingerprint import ModelFingerprint, fingerprint_model
from prescient.traces import TraceManifest, TraceWriter

VOCAB, LAYERS, EXPERTS, TOP_K = 40, 3, 8, 2


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Every predictor test runs on one thread (see `single_thread` in tests/conftest.py)."""


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=LAYERS,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K, max_position_embeddings=256,
    )
    path = tmp_path_factory.mktemp("tiny-mixtral")
    MixtralForCausalLM(config).eval().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_fingerprint(tiny_model_dir) -> ModelFingerprint:
    return fingerprint_model(MixtralForCausalLM.from_pretrained(tiny_model_dir))


def write_trace(
    path: Path,
    sequences: list[list[int]],
    logits: torch.Tensor,
    fingerprint: ModelFingerprint,
    top_t: int,
    settings: dict | None = None,
    shard_sequences: int = 16,
) -> Path:
    """A complete trace of `sequences` whose router logits are `logits` [N, L, E] (rows in
    sequence order); top-k and top-T are derived from them like a router would."""
    writer = TraceWriter(path, TraceManifest(fingerprint, "synthetic", "train", top_t, settings or {}))
    topk = logits.topk(fingerprint.top_k, dim=-1).indices.to(torch.int16)
    topt = logits.topk(top_t, dim=-1)
    row = 0
    for first in range(0, len(sequences), shard_sequences):
        chunk = sequences[first:first + shard_sequences]
        n = sum(len(s) for s in chunk)
        rows = slice(row, row + n)
        writer.add_shard(
            {
                "seq_id": torch.cat([torch.full((len(s),), first + i) for i, s in enumerate(chunk)]).long(),
                "position": torch.cat([torch.arange(len(s)) for s in chunk]).int(),
                "token_id": torch.tensor([t for s in chunk for t in s]).long(),
                "topk_ids": topk[rows],
                "topt_ids": topt.indices[rows].to(torch.int16),
                "topt_logits": topt.values[rows].float(),
            },
            sequences=len(chunk),
        )
        row += n
    writer.finish()
    return path


def logits_for(topk: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Router logits [N, L, E] whose top-k is exactly `topk` [N, L, k] (best first)."""
    k = topk.shape[-1]
    logits = torch.zeros(*topk.shape[:-1], n_experts)
    return logits.scatter_(-1, topk.long(), torch.arange(k, 0, -1, dtype=torch.float32).expand(topk.shape).contiguous())


def synthetic_logits(sequences: list[list[int]], seed: int = 0, layers: int = LAYERS) -> torch.Tensor:
    """Learnable routing: each layer's logits depend on the token and the one before it."""
    gen = torch.Generator().manual_seed(seed)
    by_token = torch.randn(layers, VOCAB, EXPERTS, generator=gen) * 2
    by_prev = torch.randn(layers, VOCAB, EXPERTS, generator=gen)
    out = []
    for s in sequences:
        tokens = torch.tensor(s)
        prev = torch.cat([torch.zeros(1, dtype=torch.long), tokens[:-1]])
        out.append((by_token[:, tokens] + by_prev[:, prev]).transpose(0, 1))
    return torch.cat(out)


@pytest.fixture(scope="session")
def make_synthetic_trace(tiny_model_dir, tiny_fingerprint) -> Callable[..., Path]:
    def make(path: Path, n_seqs: int = 48, seq_len: int = 24, seed: int = 0, top_t: int = 6,
             record_model: bool = True, fingerprint: ModelFingerprint | None = None) -> Path:
        gen = torch.Generator().manual_seed(seed + 1)
        sequences = [torch.randint(0, VOCAB, (seq_len,), generator=gen).tolist() for _ in range(n_seqs)]
        settings = {"model": str(tiny_model_dir)} if record_model else {}
        fingerprint = fingerprint or tiny_fingerprint
        return write_trace(path, sequences, synthetic_logits(sequences), fingerprint, top_t, settings)

    return make


@pytest.fixture(scope="session")
def synthetic_trace(tmp_path_factory, make_synthetic_trace) -> Path:
    return make_synthetic_trace(tmp_path_factory.mktemp("trace") / "synthetic")


@pytest.fixture(scope="session")
def make_hand_trace(tiny_fingerprint) -> Callable[..., Path]:
    """Write a trace whose router choices are exactly `topk` [N, L, k] (top-T = all experts)."""

    def make(path: Path, sequences: list[list[int]], topk: torch.Tensor) -> Path:
        return write_trace(path, sequences, logits_for(topk, EXPERTS), tiny_fingerprint, EXPERTS)

    return make
