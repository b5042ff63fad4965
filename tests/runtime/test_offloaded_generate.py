"""Greedy generation through `load_offloaded` equals the plain transformers model, token for
token, for every supported architecture, budget and a few policies; with and without a
predictor attached. Real tiny checkpoints, real threads, real files."""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import pytest
import torch

from cli import args as cli_args
from cli import generate as generate_cli
from offload_runtime.engine.loader import load_offloaded
from predictor import FrequencyPredictor, PredictorMeta, TokenTablePredictor, save_predictor
from prescient.arch import moe_stacks
from prescient.budget import Budget
from prescient.fingerprint import fingerprint_model
from prescient.loading import load_model, load_tokenizer

PROMPTS = ["def f(x):\n    return", "The cache keeps the experts that the router will choose next, in order"]
NEW_TOKENS = 4
_reference: dict[str, torch.Tensor] = {}


def encode(path: Path, encoder_decoder: bool) -> dict[str, torch.Tensor]:
    """Two prompts of different lengths: left padding for a decoder (as generation needs)."""
    tokenizer = load_tokenizer(path)
    tokenizer.padding_side = "right" if encoder_decoder else "left"
    return dict(tokenizer(PROMPTS, return_tensors="pt", padding=True))


def generate(model, inputs: dict[str, torch.Tensor], new_tokens: int = NEW_TOKENS) -> torch.Tensor:
    with torch.inference_mode():
        return model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=model.config.pad_token_id)


def reference(tiny_moe) -> torch.Tensor:
    if tiny_moe.arch not in _reference:
        _reference[tiny_moe.arch] = generate(tiny_moe.load(), encode(tiny_moe.path, tiny_moe.is_encoder_decoder))
    return _reference[tiny_moe.arch]


@pytest.mark.parametrize(("budget", "policy"), [(0.25, "lru"), (0.5, "mrs"), (1.0, "fifo")])
def test_generate_equals_plain_model(tiny_moe, budget, policy):
    """Two left-padded prompts; at 0.25 the prompt uses more experts per layer than there are
    slots (chunked experts), at 1.0 every expert fits."""
    inputs = encode(tiny_moe.path, tiny_moe.is_encoder_decoder)
    model = load_offloaded(tiny_moe.path, policy=policy, budget=budget)
    with model.runtime as runtime:
        out = generate(model, inputs)
    assert torch.equal(out, reference(tiny_moe))
    stats = runtime.stats()
    assert stats.misses > 0 and stats.loads >= stats.misses and stats.prefetch_inserts == 0
    if budget < 1.0:
        assert stats.evictions > 0


def test_switch_runs_experts_in_chunks_when_slots_are_few(tiny_moe_dir):
    """One slot: every layer's experts load one after another, each on its own tokens."""
    path = tiny_moe_dir("switch_transformers")
    inputs = encode(path, encoder_decoder=True)
    plain, _ = load_model(path, dtype=torch.float32)
    model = load_offloaded(path, policy="lru", budget=1 / 16)
    chosen = []  # experts the encoder's first MoE layer picks for the prompt
    model.runtime.layers[0].router.register_forward_hook(
        lambda _m, _i, out: chosen.append(int((out[0].sum((0, 1)) > 0).sum())))
    with model.runtime as runtime:
        assert torch.equal(generate(model, inputs), generate(plain, inputs))
    assert runtime.stats().slots == 1 and chosen[0] > 1


def test_generate_one_prompt_lfu_host_store(tiny_moe_dir):
    path = tiny_moe_dir("mixtral")
    inputs = dict(load_tokenizer(path)(PROMPTS[:1], return_tensors="pt"))
    plain, _ = load_model(path, dtype=torch.float32)
    model = load_offloaded(path, policy="lfu", budget="60KiB", store="host")
    with model.runtime:
        assert torch.equal(generate(model, inputs), generate(plain, inputs))


def save_tiny_predictor(kind: str, path: Path, out: Path) -> Path:
    """A frequency or token-table predictor of the model at `path`, from a synthetic trace's
    counts, saved as an artifact."""
    model, layers = load_model(path, dtype=torch.float32)
    fingerprint = fingerprint_model(model, layers)
    meta = PredictorMeta(kind, fingerprint, training={"dataset": "synthetic"})
    shape = (fingerprint.n_moe_layers, fingerprint.n_experts)
    generator = torch.Generator().manual_seed(0)
    if kind == "frequency":
        predictor = FrequencyPredictor(torch.randint(0, 20, shape, generator=generator).float(), meta)
    else:
        counts = torch.randint(0, 5, (fingerprint.vocab_size, *shape), generator=generator).float()
        predictor = TokenTablePredictor(counts, meta)
    return save_predictor(predictor, out / kind)


def wait_for_tables(model) -> None:
    """Make each forward wait for its hash table (a pre-hook after the runtime's), so that
    every table is on time and the prefetch path runs deterministically."""
    runtime = model.runtime

    def hook(_module, _args, _kwargs):
        deadline = time.monotonic() + 10
        while runtime.builder.poll(runtime.step) is None:
            assert time.monotonic() < deadline, f"no hash table for forward {runtime.step} within 10 s"
            time.sleep(0.001)

    for stack in moe_stacks(model, runtime.layers):
        stack.module.register_forward_pre_hook(hook, with_kwargs=True)


@pytest.mark.parametrize(("arch", "kind", "budget", "policy", "synced"), [
    ("mixtral", "frequency", 0.5, "lru", True),
    ("qwen3_moe", "token-table", 0.5, "mrs", True),
    ("deepseek_v3", "token-table", 1.0, "lfu", True),
    ("olmoe", "token-table", 0.5, "fifo", False),
])
def test_generate_with_predictor(tiny_moe_dir, tmp_path, arch, kind, budget, policy, synced):
    path = tiny_moe_dir(arch)
    artifact = save_tiny_predictor(kind, path, tmp_path)
    inputs = encode(path, encoder_decoder=False)
    plain, _ = load_model(path, dtype=torch.float32)
    want = generate(plain, inputs, new_tokens=6)
    model = load_offloaded(path, prediction_guard=False, predictor=artifact, policy=policy, budget=budget)
    if synced:
        wait_for_tables(model)
    with model.runtime as runtime:
        out = generate(model, inputs, new_tokens=6)
    assert torch.equal(out, want)
    stats = runtime.stats()
    assert stats.forwards == 6
    assert stats.tables_on_time + stats.late_tables == stats.forwards
    if synced:  # without the wait, whether a table is on time is a race
        assert stats.tables_on_time == stats.forwards
        assert stats.prefetch_inserts > 0 and stats.prefetch_loads > 0 and stats.prefetch_hits > 0
    assert 0.0 <= stats.prefetch_accuracy <= 1.0


class StreamRecordingPredictor(TokenTablePredictor):
    """A token table that remembers, per decoding state it started, the tokens it was fed."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.streams: list[list[list[int]]] = []

    def start(self, batch_size: int) -> list[list[int]]:
        self.streams.append([])
        return self.streams[-1]

    def step(self, state: list[list[int]], token_ids: torch.Tensor) -> torch.Tensor:
        state.append(token_ids.tolist())
        return super().step(None, token_ids)


def test_switch_predictor_reads_the_prompt_for_the_encoder_and_the_decoder_tokens_for_the_decoder(tiny_moe_dir):
    """The encoder's forward hashes the prompt and prefetches encoder layers; each decoder
    forward hashes the token the decoder reads (the start token, then each generated one) and
    prefetches decoder layers."""
    path = tiny_moe_dir("switch_transformers")
    inputs = encode(path, encoder_decoder=True)
    plain, layers = load_model(path, dtype=torch.float32)
    want = generate(plain, inputs, new_tokens=5)
    fingerprint = fingerprint_model(plain, layers)
    counts = torch.randint(0, 5, (fingerprint.vocab_size, fingerprint.n_moe_layers, fingerprint.n_experts),
                           generator=torch.Generator().manual_seed(0)).float()
    meta = PredictorMeta("token-table", fingerprint, training={"settings": {"decoder_reads_row_token": True}})
    predictor = StreamRecordingPredictor(counts, meta)
    model = load_offloaded(path, prediction_guard=False, predictor=predictor, policy="lru", budget=0.5)
    wait_for_tables(model)
    runtime = model.runtime
    n_encoder = len(moe_stacks(model, runtime.layers)[0].layers)
    prefetched, prefetch = [], runtime.prefetch  # (forward, layer) of each prefetched expert

    def recording_prefetch(keys, priority=0.0):
        inserted = prefetch(keys, priority)
        prefetched.extend((runtime.step, layer) for layer, _ in inserted)
        return inserted

    runtime.prefetch = recording_prefetch
    with runtime:
        out = generate(model, inputs, new_tokens=5)
    assert torch.equal(out, want)
    assert len(predictor.streams) == 2 and 0 < n_encoder < len(runtime.layers)
    assert predictor.streams[0] == inputs["input_ids"].T.tolist()  # the prompt, position by position
    assert predictor.streams[1] == out[:, :-1].T.tolist()  # the start token, then every token but the last
    assert {forward for forward, _ in prefetched} > {0}  # the encoder's forward and decoder forwards
    assert all((layer < n_encoder) == (forward == 0) for forward, layer in prefetched)
    stats = runtime.stats()
    assert stats.forwards == 6 and stats.tables_on_time == 6 and stats.prefetch_hits > 0


def test_switch_predictor_from_an_old_convention_trace_is_warned_about(tiny_moe_dir, caplog):
    path = tiny_moe_dir("switch_transformers")
    plain, layers = load_model(path, dtype=torch.float32)
    fingerprint = fingerprint_model(plain, layers)
    counts = torch.ones(fingerprint.n_moe_layers, fingerprint.n_experts)
    predictor = FrequencyPredictor(counts, PredictorMeta("frequency", fingerprint, training={"settings": {}}))
    with caplog.at_level(logging.WARNING):
        load_offloaded(path, prediction_guard=False, predictor=predictor, budget=0.5).runtime.close()
    assert "one token off" in caplog.text


def test_generate_cli_prints_and_writes_json(tiny_moe_dir, tmp_path, capsys):
    path = tiny_moe_dir("qwen2_moe")
    artifact = save_tiny_predictor("frequency", path, tmp_path)
    parser = argparse.ArgumentParser()
    generate_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["generate", "--model", str(path), "--predictor", str(artifact), "--policy", "mrs",
                              "--budget", "0.5", "--store", "host", "--prompt", PROMPTS[0],
                              "--max-new-tokens", "5", "--json", str(tmp_path / "out.json")])
    generate_cli.run(args)
    record = json.loads((tmp_path / "out.json").read_text())
    inputs = dict(load_tokenizer(path)(PROMPTS[0], return_tensors="pt"))
    plain, _ = load_model(path, dtype=torch.float32)
    want = generate(plain, inputs, new_tokens=5)[0, inputs["input_ids"].shape[1]:].tolist()
    assert record["token_ids"] == want
    assert record["settings"]["budget"] == 0.5 and record["settings"]["policy"] == "mrs"
    assert record["stats"]["forwards"] == 5 and record["stats"]["accesses"] > 0 and record["tokens_per_s"] > 0
    printed = capsys.readouterr().out
    assert printed.startswith(record["text"]) and "hit rate" in printed and "late" in printed


@pytest.mark.parametrize(("text", "budget"), [("0.5", Budget(0.5, "fraction")), ("50%", Budget(0.5, "fraction")),
                                              ("1", Budget(1.0, "fraction")), ("12slots", Budget(12, "slots")),
                                              ("512MiB", Budget(2**29, "bytes"))])
def test_budget_parsing(text, budget):
    assert cli_args.budget(text) == budget


@pytest.mark.parametrize("text", ["48", "4096", "half", "0", "150%"])
def test_a_budget_without_a_unit_or_out_of_range_is_refused_naming_the_units(text):
    with pytest.raises(argparse.ArgumentTypeError, match="12slots"):
        cli_args.budget(text)