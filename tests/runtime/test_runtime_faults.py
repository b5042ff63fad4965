"""What goes wrong around the offloading runtime, and what the user then sees: a budget too
small, a predictor of another model, a failing predictor thread, an interrupt inside generate,
a doctored checkpoint. After each, no runtime thread is left and nothing hangs."""

from __future__ import annotations

import faulthandler
import gc
import shutil
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

from offload_runtime.engine.hash_builder import HashBuilderError
from offload_runtime.engine.loader import load_offloaded
from offload_runtime.engine.options import OptionsError, RuntimeOptions
from offload_runtime.engine.store import StoreError
from predictor import FrequencyPredictor, PredictorMeta, save_predictor
from prescient.errors import CapacityError, FingerprintMismatchError
from prescient.fingerprint import fingerprint_model
from prescient.loading import load_model, load_tokenizer

RUNTIME_THREADS = ("hash-builder", "expert-transfer")


def runtime_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(RUNTIME_THREADS)]


@pytest.fixture(autouse=True)
def watchdog():
    """A hang fails the run with every thread's traceback instead of blocking it."""
    assert runtime_threads() == []
    faulthandler.dump_traceback_later(120, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()
    assert runtime_threads() == [], "a runtime thread outlived its test"


def frequency_predictor(model_dir, cls=FrequencyPredictor) -> FrequencyPredictor:
    model, layers = load_model(model_dir, dtype=torch.float32)
    fingerprint = fingerprint_model(model, layers)
    counts = torch.arange(fingerprint.n_moe_layers * fingerprint.n_experts, dtype=torch.float32)
    return cls(counts.reshape(fingerprint.n_moe_layers, fingerprint.n_experts), PredictorMeta(cls.kind, fingerprint))


def generate(model, new_tokens: int = 4) -> torch.Tensor:
    tokenizer = load_tokenizer(model.name_or_path)
    tokenizer.padding_side = "left"
    inputs = tokenizer(["def f(x):", "import os, sys"], return_tensors="pt", padding=True)
    with torch.inference_mode():
        return model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=tokenizer.pad_token_id)


def test_budget_below_top_k_names_the_minimum(tiny_moe_dir):
    path = tiny_moe_dir("mixtral")  # 2 MoE layers x 8 experts, top-2
    with pytest.raises(CapacityError, match=r"buys 1 expert slots; the minimum is one layer's top-k = 2 slots "
                                            r"\(24576 bytes, or a fraction of at least 0\.1250\)"):
        load_offloaded(path, budget=1 / 16)
    with pytest.raises(CapacityError, match="minimum is one layer's top-k = 2"):
        load_offloaded(path, budget="20KiB")


def test_predictor_of_another_model_names_both_fingerprints(tiny_moe_dir, tmp_path):
    mixtral, olmoe = tiny_moe_dir("mixtral"), tiny_moe_dir("olmoe")
    other = frequency_predictor(olmoe)
    artifact = save_predictor(other, tmp_path / "olmoe-frequency")
    model, layers = load_model(mixtral, dtype=torch.float32)
    this = fingerprint_model(model, layers)
    with pytest.raises(FingerprintMismatchError) as raised:
        load_offloaded(mixtral, predictor=artifact)
    assert str(this) in str(raised.value) and str(other.meta.fingerprint) in str(raised.value)
    with pytest.raises(FingerprintMismatchError, match="olmoe"):  # a predictor object is checked too
        load_offloaded(mixtral, predictor=other)


class FailingPredictor(FrequencyPredictor):
    """Raises on its `fail_at`-th step call (0: the prompt's first token)."""

    fail_at = 0

    def start(self, batch_size: int) -> None:
        self.calls = 0

    def step(self, state: None, token_ids: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls > self.fail_at:
            raise ValueError("predictor exploded")
        return super().step(state, token_ids)


@pytest.mark.parametrize("fail_at", [0, 15])  # in the prompt's prediction; at a decode step
def test_predictor_thread_error_surfaces_in_generate(tiny_moe_dir, fail_at):
    path = tiny_moe_dir("mixtral")
    predictor = frequency_predictor(path, FailingPredictor)
    predictor.fail_at = fail_at
    # no guard: on a tiny model it would put the predictor to sleep before step 15 (it costs more than it saves)
    model = load_offloaded(path, predictor=predictor, budget=0.5, prediction_guard=False)
    runtime = model.runtime
    with pytest.raises(HashBuilderError, match="predictor exploded") as raised:
        generate(model, new_tokens=12)
    assert isinstance(raised.value.__cause__, ValueError)
    assert runtime.cache.pinned() == {}  # the interrupted layer released its experts
    with pytest.raises(HashBuilderError):  # the runtime stays failed, it does not go on silently
        generate(model)
    runtime.close()
    runtime.close()


def test_a_failing_predictor_with_on_predictor_error_demand_is_counted_and_the_run_goes_on(tiny_moe_dir):
    """What serve runs with (`RuntimeOptions.on_predictor_error`): the failure is logged and counted,
    and the model decodes on with demand loads alone, its tokens unchanged."""
    path = tiny_moe_dir("mixtral")
    want = generate(load_model(path, dtype=torch.float32)[0], new_tokens=12)
    predictor = frequency_predictor(path, FailingPredictor)
    predictor.fail_at = 15
    with load_offloaded(path, predictor=predictor, budget=0.5, prediction_guard=False, expert_kernel="model",
                        on_predictor_error="demand") as model:
        assert torch.equal(generate(model, new_tokens=12), want)
        assert model.runtime.stats().predictor_failures == 1 and model.runtime.builder is None
    with pytest.raises(OptionsError, match="on_predictor_error must be one of raise, demand"):
        RuntimeOptions(on_predictor_error="ignore")


def test_keyboard_interrupt_inside_generate_then_close(tiny_moe_dir):
    path = tiny_moe_dir("qwen3_moe")
    model = load_offloaded(path, predictor=frequency_predictor(path), policy="mrs", budget=0.5)
    runtime = model.runtime
    calls = []

    def interrupt(_module, _inputs, _output):
        calls.append(1)
        if len(calls) == 3:  # the second decode step, after layer 0's experts ran
            raise KeyboardInterrupt

    handle = model.model.layers[0].register_forward_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        generate(model)
    assert len(calls) == 3 and runtime.cache.pinned() == {}
    handle.remove()  # the model is still usable after the interrupt
    plain, _ = load_model(path, dtype=torch.float32)
    plain.name_or_path = model.name_or_path
    assert torch.equal(generate(model), generate(plain))
    runtime.close()


def test_context_manager_closes_on_error(tiny_moe_dir):
    path = tiny_moe_dir("mixtral")
    model = load_offloaded(path, predictor=frequency_predictor(path), budget=0.25)
    with pytest.raises(RuntimeError, match="boom"), model.runtime:
        generate(model, new_tokens=2)
        assert len(runtime_threads()) == 1  # the transfer worker (the hash builder runs inline on the CPU)
        raise RuntimeError("boom")
    assert runtime_threads() == []
    model.runtime.close()  # idempotent


def test_doctored_expert_dtype_names_layer_and_expert(tiny_moe_dir, tmp_path):
    """The store checks every expert at start-up. (An expert of the wrong *shape* is already
    refused by transformers' own loading, which stacks the experts.)"""
    path = shutil.copytree(tiny_moe_dir("mixtral"), tmp_path / "doctored")
    tensors = load_file(path / "model.safetensors")
    key = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    tensors[key] = tensors[key].half()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(StoreError, match=r"layer 1 expert 3: checkpoint tensor .*experts\.3\.w2\.weight.*float16"):
        load_offloaded(path, budget=0.5)


def test_runtimes_never_closed_stop_their_threads_once_collected(tiny_moe_dir):
    path = tiny_moe_dir("mixtral")
    predictor = frequency_predictor(path)
    for _ in range(3):  # each load starts a transfer and a hash-building thread
        model = load_offloaded(path, predictor=predictor, budget=0.5)
        assert len(generate(model, new_tokens=1)) == 2
    assert len(runtime_threads()) >= 2
    del model
    gc.collect()
    assert runtime_threads() == []
