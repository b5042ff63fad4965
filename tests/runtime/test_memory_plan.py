"""`--memory SIZE`: a cap for the whole process picks the plain model where every expert fits,
sized slots where they do not, and refuses a cap too small naming the smallest that works;
every path computes what the plain model computes."""

from __future__ import annotations

import ctypes

import psutil
import pytest
import torch

from offload_runtime.engine import loader
from offload_runtime.engine import generate as generate_module
from offload_runtime.engine.generate import generate_offloaded, storage_reads
from offload_runtime.engine.loader import load_offloaded
from offload_runtime.engine.mapped import mapped_share
from offload_runtime.engine.memory_plan import MemoryPlanner, MiB, plan_offloaded, plan_resident, reserve_bytes, workspace_bytes
from offload_runtime.engine.model_runtime import ModelRuntime
from offload_runtime.engine.options import OptionsError, RuntimeOptions
from offload_runtime.engine.resident import ResidentRuntime
from offload_runtime.engine.runtime import OffloadRuntime
from prescient.budget import parse_memory
from prescient.devices import DeviceError
from prescient.errors import CapacityError
from prescient.fingerprint import fingerprint_model_dir
from prescient.loading import load_model
from prescient.memory_cap import CODE_BYTES, HOT_LIBRARY_BYTES, process_footprint
from prescient.model_dir import ModelDirectory
from tests.runtime.test_offloaded_generate import encode, generate

FOOTPRINT = 400 * MiB  # a fixed process footprint, so that slot counts do not depend on this process


def test_offloaded_plan_buys_the_slots_left_and_refuses_below_the_smallest_cap_it_names():
    plan = plan_offloaded(1000 * MiB, FOOTPRINT, 100 * MiB, 10 * MiB, 64, 2)
    assert (plan.slots, plan.resident) == (50, False)
    assert plan_offloaded(10_000 * MiB, FOOTPRINT, 100 * MiB, 10 * MiB, 64, 2).slots == 64  # capped at every expert
    with pytest.raises(CapacityError, match=r"smallest memory that works is 0\.51 GiB \(520MiB\)") as refused:
        plan_offloaded(510 * MiB, FOOTPRINT, 100 * MiB, 10 * MiB, 64, 2)
    assert len(str(refused.value).splitlines()) == 1
    assert plan_offloaded(520 * MiB, FOOTPRINT, 100 * MiB, 10 * MiB, 64, 2).slots == 2  # the named cap works


def test_resident_plan_only_when_every_expert_fits_beside_the_rest():
    assert plan_resident(1000 * MiB, FOOTPRINT, 100 * MiB, 500 * MiB, 64).resident
    assert plan_resident(999 * MiB, FOOTPRINT, 100 * MiB, 500 * MiB, 64) is None


def test_the_resident_plan_leaves_the_file_pages_the_process_runs():
    """Copied experts are anonymous memory the cgroup cannot reclaim: a cap that holds them beside
    `CODE_BYTES` but not beside the file pages measured (runs/tb at plain's 1100 MiB: 134 MiB after
    the imports, 1.0-1.4 major faults a token resident) does not copy them."""
    fits = FOOTPRINT + 100 * MiB + 500 * MiB
    assert plan_resident(fits, FOOTPRINT, 100 * MiB, 500 * MiB, 64, CODE_BYTES).resident
    assert plan_resident(fits, FOOTPRINT, 100 * MiB, 500 * MiB, 64, CODE_BYTES + 64 * MiB) is None
    plan = plan_resident(fits + 64 * MiB, FOOTPRINT, 100 * MiB, 500 * MiB, 64, CODE_BYTES + 64 * MiB)
    assert plan.footprint == FOOTPRINT + 64 * MiB and "96 MiB of file pages it runs" in plan.line()


@pytest.mark.parametrize(("text", "size"), [("8GiB", 8 * 2**30), ("1.5GB", 1_500_000_000), ("700MiB", 700 * MiB)])
def test_memory_sizes(text, size):
    assert parse_memory(text) == size
    assert RuntimeOptions(memory=text).memory == size


@pytest.mark.parametrize("text", ["12", "lots", "0GiB", "0%", "150%"])
def test_a_memory_size_without_a_unit_or_out_of_range_is_refused_naming_the_forms(text):
    with pytest.raises(CapacityError, match="8GiB"):
        parse_memory(text)


def test_memory_and_budget_together_are_refused():
    with pytest.raises(OptionsError, match="not both"):
        RuntimeOptions(memory="1GiB", budget=0.5)
    with pytest.raises(OptionsError, match="host store"):
        RuntimeOptions(memory="1GiB", store="host")


def _model(tiny_moe_dir, dtype: str = "float32"):
    path = tiny_moe_dir("mixtral")
    directory = ModelDirectory.open(path)
    reference = generate(load_model(path, dtype=getattr(torch, dtype))[0], encode(path, False))
    return path, directory, reference


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_cap_that_holds_every_expert_runs_the_plain_model_without_hooks(tiny_moe_dir, dtype):
    path, _, reference = _model(tiny_moe_dir, dtype)
    model = load_offloaded(path, memory="16GiB", dtype=dtype)
    assert isinstance(model.runtime, ResidentRuntime) and isinstance(model.runtime, ModelRuntime)
    assert not any(module._forward_hooks or module._forward_pre_hooks
                   for name, module in model.named_modules() if name)  # only the model's forward counter
    with model.runtime as runtime:
        out = generate(model, encode(path, False))
    assert torch.equal(out, reference)
    assert runtime.stats().forwards > 0 and runtime.memory_plan.resident
    # copied into memory, as the plain transformers model loads it: not mapped from the checkpoint
    assert not runtime.memory_plan.mapped and not hasattr(model, "mmaps")


def test_mapped_experts_are_the_checkpoint_itself_and_only_where_asked(tiny_moe_dir, monkeypatch):
    """Mapped where `map_experts` asks; not by default where most experts fit (the slots' kernels
    decoded runs/tb 1.6x the mapped model with 61 of 64 experts in slots)."""
    path, directory, reference = _model(tiny_moe_dir)
    mapped = load_offloaded(path, memory="16GiB", map_experts=True)
    assert mapped_share(mapped) == 1.0  # nothing copied
    assert mapped.runtime.fingerprint == fingerprint_model_dir(path)  # the same model, as predictors know it
    monkeypatch.setattr(loader, "process_footprint", lambda reads=True: FOOTPRINT)
    need = MemoryPlanner(directory, RuntimeOptions()).need(FOOTPRINT)
    cap = need.footprint + need.reserve + int(0.9 * need.experts_bytes)  # not every expert fits
    for map_experts, is_mapped in ((None, False), (True, True)):
        model = load_offloaded(path, memory=cap, map_experts=map_experts)
        assert model.runtime.memory_plan.mapped == is_mapped == hasattr(model, "mmaps")
        assert torch.equal(generate(model, encode(path, False)), reference)
        model.runtime.close()


def test_mapping_asked_for_below_the_whole_model_runs_exact_and_refuses_below_a_layers_top_k(tiny_moe_dir, monkeypatch):
    path, directory, reference = _model(tiny_moe_dir)
    monkeypatch.setattr(loader, "process_footprint", lambda reads=True: FOOTPRINT)
    need = MemoryPlanner(directory, RuntimeOptions()).need(FOOTPRINT)
    fixed, expert_bytes = need.footprint + need.reserve, need.experts_bytes // need.total_experts
    model = load_offloaded(path, memory=fixed + 4 * expert_bytes, map_experts=True)
    with model.runtime as runtime:
        assert runtime.memory_plan.mapped and "page cache holds ~" in runtime.memory_plan.line()
        assert torch.equal(generate(model, encode(path, False)), reference)
    with pytest.raises(CapacityError, match="experts in the page cache"):
        load_offloaded(path, memory=FOOTPRINT, map_experts=True)


def test_a_cap_at_the_whole_models_need_takes_slots_where_copies_would_evict_the_file_pages_it_runs(
        tiny_moe_dir, monkeypatch):
    path, directory, reference = _model(tiny_moe_dir)
    monkeypatch.setattr(loader, "process_footprint", lambda reads=True: FOOTPRINT)
    need = MemoryPlanner(directory, RuntimeOptions()).need(FOOTPRINT)
    monkeypatch.setattr(loader, "file_backed_bytes", lambda: CODE_BYTES)
    assert load_offloaded(path, memory=need.total).runtime.memory_plan.resident  # fits beside the code
    monkeypatch.setattr(loader, "file_backed_bytes", lambda: CODE_BYTES + 134 * MiB)  # the libraries' pages, measured
    with load_offloaded(path, memory=need.total).runtime as runtime:
        plan = runtime.memory_plan
        assert not plan.resident and not plan.mapped  # slots, sized by their own plan
        assert "not every expert copied" in plan.line() and "166 MiB of file pages it runs (measured)" in plan.line()
        assert torch.equal(generate(runtime.model, encode(path, False)), reference)


def test_memory_settings_need_a_memory_cap_and_the_request_sizes_the_reserve(tiny_moe_dir):
    for settings in ({"map_experts": True}, {"context_tokens": 64}, {"map_experts": True, "memory": "1GiB",
                                                                      "device": "meta"}):
        with pytest.raises((OptionsError, DeviceError)):
            RuntimeOptions(**settings)
    config = ModelDirectory.open(tiny_moe_dir("mixtral")).config
    assert reserve_bytes(config, 4, 0, context_tokens=40) < reserve_bytes(config, 4, 0)
    record = generate_offloaded(tiny_moe_dir("mixtral"), "def f(x):", 4, memory="16GiB")
    prompt_tokens = len(ModelDirectory.open(tiny_moe_dir("mixtral")).tokenizer()("def f(x):")["input_ids"])
    assert record["settings"]["context_tokens"] == prompt_tokens + 4
    assert record["decode_major_faults_per_token"] >= 0  # counted over the 3 tokens after the first
    if storage_reads() is not None:  # Linux
        assert record["decode_read_bytes_per_token"] >= 0


def test_the_token_clock_counts_reads_from_the_first_new_token_to_the_last(monkeypatch):
    """Put 0 is the prompt, put 1 the first new token: decoding is from put 1 to the last."""
    reads = iter([0, 500, 1_000, 1_600, 2_200, 9_999])
    monkeypatch.setattr(generate_module, "storage_reads", lambda: next(reads))
    clock = generate_module.TokenClock()
    for put in range(5):  # the prompt, then 4 new tokens
        clock.put(put)
    assert clock.decode_read_bytes_per_token(4) == (2_200 - 500) / 3  # puts 1 (first token) to 4
    assert clock.decode_read_bytes_per_token(1) is None


def test_the_prefill_workspace_counts_each_tokens_top_k_rows(tiny_moe_dir):
    """The experts' kernels take a layer's top-k rows at once: twice the experts per token, twice
    the FFN activations."""
    config = ModelDirectory.open(tiny_moe_dir("mixtral")).config
    wider = type(config).from_dict({**config.to_dict(), "num_experts_per_tok": 2 * config.num_experts_per_tok})
    ffn = 512 * 3 * config.intermediate_size * 4
    assert workspace_bytes(wider, 4) - workspace_bytes(config, 4) == ffn * config.num_experts_per_tok


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_cap_below_the_whole_model_buys_the_slots_it_can_and_computes_the_same(tiny_moe_dir, monkeypatch, dtype):
    path, directory, reference = _model(tiny_moe_dir, dtype)
    monkeypatch.setattr(loader, "process_footprint", lambda reads=True: FOOTPRINT)
    probe = load_offloaded(path, budget=1.0, dtype=dtype)
    expert_bytes, total = probe.runtime.pool.spec.nbytes, probe.runtime.pool.num_slots
    probe.runtime.close()
    reserve = reserve_bytes(directory.config, getattr(torch, dtype).itemsize, expert_bytes)  # one transfer worker
    model = load_offloaded(path, memory=FOOTPRINT + reserve + 5 * expert_bytes, dtype=dtype)
    with model.runtime as runtime:
        out = generate(model, encode(path, False))
    assert isinstance(runtime, OffloadRuntime) and isinstance(runtime, ModelRuntime) and runtime.pool.num_slots == 5 < total
    assert runtime.memory_plan.slots == 5 and not runtime.memory_plan.resident
    assert torch.equal(out, reference)


def test_a_cap_too_small_is_refused_in_one_line_naming_the_smallest(tiny_moe_dir, monkeypatch):
    path, _, _ = _model(tiny_moe_dir)
    monkeypatch.setattr(loader, "process_footprint", lambda reads=True: FOOTPRINT)
    with pytest.raises(CapacityError, match="smallest memory that works"):
        load_offloaded(path, memory=FOOTPRINT)


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "malloc_trim"), reason="not glibc: nothing to hand back")
def test_the_footprint_leaves_out_what_the_allocator_holds_free():
    """Memory freed inside the C heap stays resident until handed back; the slots it would cost
    are not the process's: the footprint is measured after `malloc_trim`."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
    block = 64 * 1024  # under glibc's mmap threshold: from the heap
    blocks = [libc.malloc(block) for _ in range(2048)]  # 128 MiB, touched
    for address in blocks:
        ctypes.memset(address, 1, block)
    for address in blocks[:-1]:  # the last one keeps the heap's top: nothing is trimmed on free
        libc.free(address)
    resident = psutil.Process().memory_info()
    held = resident.rss - getattr(resident, "shared", 0)
    try:
        assert process_footprint() - HOT_LIBRARY_BYTES < held - 64 * MiB
    finally:
        libc.free(blocks[-1])
