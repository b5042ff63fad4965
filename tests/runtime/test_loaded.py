"""`load_offloaded` returns a `LoadedModel`: one object that owns the transformers model, its
runtime, its memory plan and its options, and reads as the transformers model it wraps."""

from __future__ import annotations

import threading

import pytest
import torch

from offload_runtime import LoadedModel, LoadRequest, ModelRuntime, load_offloaded, resolve_options
from offload_runtime.engine.offloaded_experts import OffloadedExperts
from offload_runtime.engine.resident import ResidentRuntime
from offload_runtime.engine.runtime import OffloadRuntime
from prescient.loading import load_model, load_tokenizer
from tests.conftest import random_sida
from tests.runtime.test_runtime_faults import RUNTIME_THREADS


def runtime_threads() -> set[threading.Thread]:
    """The runtime threads alive now (by object: every runtime names its own alike)."""
    return {t for t in threading.enumerate() if t.name.startswith(RUNTIME_THREADS)}


def greedy(model, path, new_tokens: int = 4) -> torch.Tensor:
    inputs = load_tokenizer(path)("def f(x):", return_tensors="pt")
    with torch.inference_mode():
        return model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)


def test_the_loaded_model_owns_its_parts_and_reads_as_the_transformers_model(tiny_moe_dir):
    path = tiny_moe_dir("mixtral")
    reference = greedy(load_model(path, dtype=torch.float32)[0], path)
    before = runtime_threads()  # another test's runtime may still await the garbage collector
    loaded = load_offloaded(path, budget="25%", expert_kernel="model")
    with loaded:
        assert isinstance(loaded, LoadedModel) and isinstance(loaded.runtime, OffloadRuntime)
        assert isinstance(loaded.runtime, ModelRuntime) and loaded.runtime.model is loaded.module
        assert loaded.options == resolve_options(path, None, {"budget": "25%", "expert_kernel": "model"})
        assert loaded.plan is None  # a budget plans nothing
        assert not hasattr(loaded.module, "offload_runtime")  # the transformers model holds no way back
        # the transformers model's own attributes read through: its base model, config, experts replaced
        assert loaded.model is loaded.module.model and loaded.config is loaded.module.config
        assert isinstance(loaded.model.layers[0].mlp.experts, OffloadedExperts)
        assert torch.equal(greedy(loaded, path), reference)
        assert runtime_threads() - before  # its transfer worker runs ...
    assert not runtime_threads() - before  # ... until `with loaded:` ends


def test_a_cap_that_holds_every_expert_owns_a_resident_runtime_and_its_plan(tiny_moe_dir):
    path = tiny_moe_dir("mixtral")
    with load_offloaded(path, memory="16GiB") as loaded:
        assert isinstance(loaded.runtime, ResidentRuntime) and loaded.plan.resident
        assert loaded.plan is loaded.runtime.memory_plan and loaded.options.memory == 16 * 2**30


def test_a_request_is_resolved_once_and_options_whole_or_named_not_both(tiny_moe_dir):
    path = tiny_moe_dir("mixtral")
    asked = LoadRequest(path, settings={"budget": "25%"}).resolved()
    assert asked.options == resolve_options(path, None, {"budget": "25%"}) and not asked.settings
    assert asked.resolved() is asked  # already resolved: as it is
    with pytest.raises(TypeError, match="not both"):
        LoadRequest(path, options=asked.options, settings={"policy": "lru"}).resolved()


def test_forwards_inside_rows_hand_the_predictor_one_sequence_per_row(tiny_moe_dir, tmp_path, monkeypatch):
    """Serving's interface (`ModelRuntime.rows`): the forwards inside it are over those sequences, the
    predictor told so; outside it, over no sequence named; the resident runtime takes it alike."""
    path = tiny_moe_dir("mixtral")
    ids = load_tokenizer(path)(["def f(x):", "import os"], return_tensors="pt", padding=True)
    with load_offloaded(path, random_sida(path, tmp_path), budget="25%") as loaded:
        seen = []
        submit = loaded.runtime.builder.submit
        monkeypatch.setattr(loaded.runtime.builder, "submit", lambda *args, rows=None: (seen.append(rows),
                                                                                        submit(*args, rows=rows)))
        with torch.inference_mode():
            with loaded.runtime.rows(["a", "b"]):
                loaded(**ids)
            loaded(**ids)
        assert seen == [["a", "b"], None]
    with load_offloaded(path, memory="16GiB") as resident, torch.inference_mode(), resident.runtime.rows(["a", "b"]):
        assert isinstance(resident.runtime, ModelRuntime)
        resident(**ids)
