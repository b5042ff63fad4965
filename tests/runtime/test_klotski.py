"""Klotski's multi-batch pipeline and FlexGen's zig-zag schedule: greedy outputs equal each
request generated alone; each layer's experts run once per pass over the whole group; hot experts
are the correlation table's top K, the table is updated online (a copy: the caller's stays as
built); cold experts move only when activated; bad K and another model's table are refused."""

from __future__ import annotations

import pytest
import torch

from offload_runtime.cgopipe.klotski import KlotskiError, KlotskiPipe
from offload_runtime.cgopipe.pipe import CGOPipe
from offload_runtime.cgopipe.zigzag import ZigZagDecoder, budget_fraction
from offload_runtime.engine.loader import load_offloaded
from predictor import PredictorMeta
from predictor.correlation import CorrelationTable
from prescient.arch_zoo import save_tiny_model
from prescient.errors import FingerprintMismatchError
from prescient.fingerprint import fingerprint_model
from prescient.loading import load_model
from tests.conftest import tiny_test_config
from tests.runtime.test_cgopipe import NEW_TOKENS, alone, prompts


def offloaded(path, resident_fraction: float):
    config = load_model(path, dtype=torch.float32)[0].config
    n_experts = getattr(config, "num_local_experts", None) or config.num_experts
    return load_offloaded(path, policy="fifo", budget=budget_fraction(resident_fraction, config.num_hidden_layers,
                                                                      n_experts))


def random_table(path, seed: int = 0) -> CorrelationTable:
    """A correlation table of the model at `path` with random counts, as if built from a trace."""
    model, layers = load_model(path, dtype=torch.float32)
    fp = fingerprint_model(model, layers)
    generator = torch.Generator().manual_seed(seed)
    pairs = torch.randint(0, 20, (fp.n_moe_layers - 1, fp.n_experts, fp.n_experts), generator=generator).float()
    layer0 = torch.randint(0, 5, (fp.vocab_size, 1, fp.n_experts), generator=generator).float()
    return CorrelationTable([pairs], layer0, PredictorMeta(CorrelationTable.kind, fp, {"path_length": 1}))


@pytest.fixture(scope="module")
def deep_mixtral(tmp_path_factory, tiny_tokenizer):
    """Four layers of 8 experts: at r_w = 0.25, 2 resident per layer and 6 streamed."""
    return save_tiny_model(tiny_test_config("mixtral", tiny_tokenizer, num_hidden_layers=4),
                           tmp_path_factory.mktemp("deep-mixtral"), tokenizer=tiny_tokenizer)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "phimoe"])
def test_klotski_outputs_equal_each_request_alone(tiny_moe_dir, arch):
    path = tiny_moe_dir(arch)
    requests = prompts(vocab=300)
    with offloaded(path, 0.5) as model, \
            KlotskiPipe(model, 0.5, table=random_table(path)) as pipe:
        got = pipe.generate(requests, NEW_TOKENS, micro_batch_size=2, n_micro=3)
    assert got == alone(path, requests)
    assert pipe.stats.batches == 2 and pipe.stats.generated_tokens == sum(map(len, got))


@pytest.mark.parametrize("hot_count", [0, 2, 6])
def test_klotski_streams_exactly_with_every_hot_count(deep_mixtral, hot_count):
    requests = prompts(vocab=300)
    with offloaded(deep_mixtral, 0.25) as model, \
            KlotskiPipe(model, 0.25, table=random_table(deep_mixtral), hot_count=hot_count) as pipe:
        got = pipe.generate(requests, NEW_TOKENS, micro_batch_size=2, n_micro=2)
        stats = model.runtime.stats()
    assert got == alone(deep_mixtral, requests)
    assert stats.evictions > 0 and stats.demand_loads > 0  # experts did stream, cold ones on demand


def test_flexgen_zigzag_outputs_and_order(deep_mixtral):
    """Layer by layer: the next layer's streamed experts requested (at layer 0 its own too),
    every micro-batch's attention, then every micro-batch's FFN."""
    requests = prompts(vocab=300)[:4]
    with offloaded(deep_mixtral, 0.25) as model, \
            ZigZagDecoder(model, 0.25, record_events=True) as pipe:
        got = pipe.generate(requests, 3, micro_batch_size=2, n_micro=2)
    assert got == [out[:3] for out in alone(deep_mixtral, requests)]
    expected = []
    for layer in range(4):
        expected += [("page", 0, -1)] * (layer == 0) + [("page", (layer + 1) % 4, -1)]
        expected += [("attention", layer, 0), ("attention", layer, 1), ("ffn", layer, 0), ("ffn", layer, 1)]
    assert [(e.op, e.layer, e.micro_batch) for e in pipe.events if e.step == 1] == expected


def test_each_expert_runs_once_per_layer_over_the_whole_group(deep_mixtral):
    """One MoE call per layer and pass, over every micro-batch's tokens (the prefill: every
    prompt token; a decode step: one token per request); hot experts requested before the
    group's attention, the MoE after it."""
    requests = prompts(vocab=300)[:4]  # micro-batches of 2: prompt widths 9 and 6 (padded)
    calls: list[tuple[int, int]] = []
    with offloaded(deep_mixtral, 0.25) as model, \
            KlotskiPipe(model, 0.25, table=random_table(deep_mixtral), record_events=True) as pipe:
        hooks = [layer.experts.register_forward_pre_hook(
                     lambda module, args, index=layer.index: calls.append((index, args[1].shape[0])))
                 for layer in model.runtime.layers]
        pipe.generate(requests, 3, micro_batch_size=2, n_micro=2)
        for hook in hooks:
            hook.remove()
    prefill_rows = 2 * 9 + 2 * 6
    assert calls == [(layer, prefill_rows) for layer in range(4)] + [(layer, 4) for _ in range(2) for layer in range(4)]
    for step in (1, 2):
        events = [(e.op, e.layer, e.micro_batch) for e in pipe.events if e.step == step]
        for layer in range(4):
            mine = [event for event in events if event[1] == layer]
            ops = [op for op, _, _ in mine]
            assert ops[-3:] == ["attention", "attention", "moe"] and set(ops[:-3]) <= {"page"}


@pytest.mark.parametrize("early_hot", [True, False])
def test_hot_experts_are_requested_after_the_previous_gate_or_at_attention(deep_mixtral, early_hot):
    """early_hot: layer i's hot experts go out while layer i−1's MoE block runs (its gate has
    chosen), before that block ends; as the paper: at layer i, before its attention."""
    requests = prompts(vocab=300)[:4]
    with offloaded(deep_mixtral, 0.25) as model, \
            KlotskiPipe(model, 0.25, table=random_table(deep_mixtral), record_events=True,
                        early_hot=early_hot) as pipe:
        got = pipe.generate(requests, 3, micro_batch_size=2, n_micro=2)
    assert got == [out[:3] for out in alone(deep_mixtral, requests)]
    events = [(e.op, e.layer, e.micro_batch) for e in pipe.events if e.step == 1]
    for layer in range(1, 4):
        page = events.index(("page", layer, -1))
        if early_hot:
            assert events[page + 1] == ("moe", layer - 1, -1)
        else:
            assert events[page + 1] == ("attention", layer, 0)


def test_cold_experts_move_only_when_activated(deep_mixtral):
    """At one budget, CGOPipe streams every non-resident expert each step; Klotski with K = 0
    moves only the experts the group activates."""
    requests = prompts(vocab=300)[:2]
    moved = {}
    for name in ("cgopipe", "klotski"):
        with offloaded(deep_mixtral, 0.25) as model:
            pipe = CGOPipe(model, 0.25) if name == "cgopipe" else KlotskiPipe(model, 0.25, hot_count=0)
            with pipe:
                pipe.generate(requests, NEW_TOKENS, micro_batch_size=1, n_micro=2)
            moved[name] = model.runtime.stats().loads
    assert moved["klotski"] < moved["cgopipe"]


def test_hot_experts_are_the_top_of_the_summed_rows(deep_mixtral):
    """Row i of layer 0 → 1 sends every token to expert (i + 3) mod 8; tokens that chose {0, 1}
    and {0, 2} score expert 3 twice, 4 and 5 once each. Resident experts (r_w = 0.25: the two
    ranked first) are never hot; ties go to the static ranking."""
    model, layers = load_model(deep_mixtral, dtype=torch.float32)
    fp = fingerprint_model(model, layers)
    pairs = torch.zeros(3, 8, 8)
    pairs[0, torch.arange(8), (torch.arange(8) + 3) % 8] = 7.0
    table = CorrelationTable([pairs], torch.zeros(fp.vocab_size, 1, 8), PredictorMeta(CorrelationTable.kind, fp))
    by_id = [-e for e in range(8)]
    three_first = [9 if e == 3 else -e for e in range(8)]  # layer 1 keeps experts 3 and 0 resident
    cases = [(2, [by_id] * 4, [3, 4]), (3, [by_id] * 4, [3, 4, 5]), (2, [by_id, three_first, by_id, by_id], [4, 5])]
    with offloaded(deep_mixtral, 0.25) as model:
        for k, ranking, expected in cases:
            with KlotskiPipe(model, 0.25, table=table, hot_count=k, hot=ranking) as pipe:
                pipe.selected[0] = torch.tensor([[0, 1], [0, 2]])
                assert pipe.hot_experts(1, []) == expected


def test_table_is_updated_online_on_a_copy(deep_mixtral):
    table = random_table(deep_mixtral)
    before = table.pairs[0].clone()
    requests = prompts(vocab=300)[:4]
    with offloaded(deep_mixtral, 0.25) as model, \
            KlotskiPipe(model, 0.25, table=table) as pipe:
        pipe.generate(requests, 3, micro_batch_size=2, n_micro=2, eos_token_id=None)
    assert torch.equal(table.pairs[0], before)  # never written back
    tokens = sum(len(p) for p in requests) + 2 * len(requests)  # real prompt tokens, then 2 decode steps
    added = pipe.table.pairs[0] - before
    assert torch.equal(added.sum(dim=(1, 2)), torch.full((3,), float(tokens * 2 * 2)))  # top-2 × top-2 per token


def test_bad_hot_count_and_another_models_table_are_refused(deep_mixtral, tiny_moe_dir):
    with offloaded(deep_mixtral, 0.25) as model:
        with pytest.raises(KlotskiError, match="K=7 .* 0..6"):
            KlotskiPipe(model, 0.25, hot_count=7)
        with pytest.raises(KlotskiError, match="K=-1"):
            KlotskiPipe(model, 0.25, hot_count=-1)
        with pytest.raises(FingerprintMismatchError, match="correlation table"):
            KlotskiPipe(model, 0.25, table=random_table(tiny_moe_dir("mixtral")))
