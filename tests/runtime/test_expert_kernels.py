"""Load-aware expert kernels (EPS-MoE): `choose` and `pipelines` follow the crossover table; a
measured table names a kernel per load; with `expert_kernel` "auto" forced onto each kernel (and
with the pipeline on and off) or set to a fixed kernel, the runtime's greedy tokens equal the plain
model's, and its logits too where the kernel rounds as the model's does; Klotski's batch decoder
with "auto" equals each request alone; an unknown kernel is refused in one line."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralExperts

from offload_runtime.cgopipe.klotski import KlotskiPipe
from offload_runtime.engine.expert_kernels import (
    KERNELS,
    CrossoverTable,
    KernelTableError,
    choose,
    load_table,
    measure_crossover,
    pipelines,
)
from offload_runtime.engine.loader import load_offloaded
from offload_runtime.engine.options import OptionsError, RuntimeOptions
from prescient.loading import load_tokenizer
from tests.runtime.test_cgopipe import NEW_TOKENS, alone, prompts
from tests.runtime.test_exact_offloading import PROMPT, decode, plain_model
from tests.runtime.test_klotski import offloaded, random_table

TABLE = CrossoverTable(loads=(1, 4, 16), kernels=("batched_mm", "eager", "grouped_mm"), pipeline_from=4.0,
                       seconds={}, parts_seconds=[], shape={})


def forced(path, kernel: str, pipeline_from: float | None) -> str:
    """A table file that picks `kernel` at every load, the pipeline from `pipeline_from` tokens."""
    table = CrossoverTable((1,), (kernel,), pipeline_from, {}, [], {})
    path.write_text(json.dumps({"crossover": table.to_json()}))  # as `prescient bench-kernels` writes it
    return str(path)


def test_choose_follows_the_table():
    assert [choose(m, TABLE) for m in (0.5, 1, 3.9, 4, 15, 16, 1000)] == \
        ["batched_mm", "batched_mm", "batched_mm", "eager", "eager", "grouped_mm", "grouped_mm"]
    assert [pipelines(m, TABLE) for m in (1, 3.9, 4, 64)] == [False, False, True, True]
    assert not pipelines(1000, CrossoverTable((1,), ("eager",), None, {}, [], {}))
    assert CrossoverTable.from_json(json.loads(json.dumps(TABLE.to_json()))) == TABLE


def test_a_bad_table_is_refused(tmp_path):
    (tmp_path / "bad.json").write_text(json.dumps({"loads": [1, 2], "kernels": ["eager", "cutlass"],
                                                   "pipeline_from": None}))
    with pytest.raises(KernelTableError, match="one kernel of"):
        load_table(tmp_path / "bad.json")
    with pytest.raises(KernelTableError, match="cannot read"):
        load_table(tmp_path / "missing.json")


def test_measure_crossover_names_a_kernel_per_load():
    experts = MixtralExperts(MixtralConfig(hidden_size=16, intermediate_size=32, num_local_experts=4))
    experts.config._experts_implementation = "grouped_mm"
    table = measure_crossover(experts, experts=4, top_k=2, loads=(1, 2, 4), repeats=1)
    assert table.loads == (1, 2, 4) and set(table.kernels) <= set(KERNELS)
    assert all(len(table.seconds[k]) == 3 for k in KERNELS) and len(table.parts_seconds) == 3
    assert table.pipeline_from in (None, 1.0, 2.0, 4.0)
    assert experts.config._experts_implementation == "grouped_mm"  # the shared config never changes
    assert CrossoverTable.from_json(table.to_json()) == table
    loyal = measure_crossover(experts, experts=4, top_k=2, loads=(1, 2), repeats=1, margin=1e9)
    assert loyal.kernels == ("grouped_mm", "grouped_mm") and loyal.model_kernel == "grouped_mm"


def greedy(model, ids):
    return decode(model, ids, sample=False)


# the model's own kernel (grouped_mm) and eager compute each expert's rows in one float32 GEMM of
# the same rows, so they match the model bit for bit; batched_mm computes row by row and may not
BIT_EXACT = {"eager", "grouped_mm"}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("pipeline_from", [None, 1.0])
def test_auto_forced_onto_each_kernel_keeps_greedy_tokens(tiny_moe_dir, tmp_path, kernel, pipeline_from):
    path = tiny_moe_dir("mixtral")
    ids = load_tokenizer(path)(PROMPT, return_tensors="pt").input_ids
    reference, _ = plain_model(path, "float32")
    assert reference.config._experts_implementation == "grouped_mm"
    want_tokens, want_logits = greedy(reference, ids)
    table = forced(tmp_path / "table.json", kernel, pipeline_from)
    for slots in (2, 5):
        model = load_offloaded(path, options=RuntimeOptions(budget=f"{slots}slots", expert_kernel="auto",
                                                            expert_kernel_table=table))
        with model.runtime:
            tokens, logits = greedy(model, ids)
        assert torch.equal(tokens, want_tokens), (kernel, slots)
        difference = (logits - want_logits).abs().max().item()
        logging.getLogger(__name__).info("auto=%s pipeline_from=%s slots=%d: max logit difference %.3g",
                                         kernel, pipeline_from, slots, difference)
        if kernel in BIT_EXACT:
            assert difference == 0.0, (kernel, slots)
        else:
            assert difference < 1e-4, (kernel, slots)


@pytest.mark.parametrize("kernel", ["eager", "batched_mm"])
def test_a_fixed_kernel_keeps_greedy_tokens(tiny_moe_dir, kernel):
    path = tiny_moe_dir("mixtral")
    ids = torch.tensor([prompts(vocab=300)[0]])
    reference, _ = plain_model(path, "float32")
    want_tokens, want_logits = greedy(reference, ids)
    model = load_offloaded(path, options=RuntimeOptions(budget="3slots", expert_kernel=kernel))
    with model.runtime:
        tokens, logits = greedy(model, ids)
    assert torch.equal(tokens, want_tokens)
    assert torch.equal(logits, want_logits) if kernel in BIT_EXACT else torch.allclose(logits, want_logits, atol=1e-4)


def test_klotski_with_auto_equals_each_request_alone(tiny_moe_dir):
    """The crossover measured at load (no table given) on the tiny model's shapes."""
    path = tiny_moe_dir("mixtral")
    requests = prompts(vocab=300)
    model = offloaded(path, 0.5)
    budget = model.runtime.options.budget
    model = load_offloaded(path, options=RuntimeOptions(policy="fifo", budget=budget, expert_kernel="auto"))
    with model, KlotskiPipe(model, 0.5, table=random_table(path)) as pipe:
        got = pipe.generate(requests, NEW_TOKENS, micro_batch_size=2, n_micro=3)
    assert got == alone(path, requests)


def test_an_unknown_kernel_is_refused():
    with pytest.raises(OptionsError, match="expert_kernel must be one of model, auto, eager"):
        RuntimeOptions(expert_kernel="cutlass")
    with pytest.raises(OptionsError, match="give --expert-kernel auto"):
        RuntimeOptions(expert_kernel_table="table.json")
    with pytest.raises(OptionsError, match="packed slots"):
        RuntimeOptions(expert_kernel="grouped_mm", slot_format="packed", dtype="bfloat16")
