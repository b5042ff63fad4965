"""Expert reads around the page cache (O_DIRECT) into slots laid out at the file's phase."""

from __future__ import annotations

import errno
import os
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from offload_runtime.engine import loader
from offload_runtime.engine import store as store_module
from offload_runtime.engine.direct_read import ALIGN, can_read_direct, open_direct, phased_empty, read_edges
from offload_runtime.engine.loader import load_offloaded
from offload_runtime.engine.memory_plan import MiB
from offload_runtime.engine.store import ExpertStore
from prescient.arch import find_moe_layers
from prescient.arch_zoo import save_tiny_model
from prescient.memory_cap import CODE_BYTES, READ_HEADROOM_BYTES
from tests.conftest import tiny_test_config


FOOTPRINT = 400 * MiB  # a fixed process footprint, so that slot counts do not depend on this process
CAP = 600 * MiB


def direct_or_skip(path) -> int:
    fd = open_direct(path)
    if fd is None:
        pytest.skip("this file system reads no file with O_DIRECT")
    return fd


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("phase", [0, 4, 3472, ALIGN - 4])
def test_phased_empty_starts_at_the_phase(phase, dtype):
    tensor = phased_empty((3, 5, 7), dtype, phase)
    assert tensor.shape == (3, 5, 7) and tensor.dtype == dtype and tensor.is_contiguous()
    assert tensor.data_ptr() % ALIGN == phase


def test_phased_empty_of_an_impossible_phase_is_a_plain_tensor():
    tensor = phased_empty((4, 4), torch.float32, 2)  # no float32 starts 2 bytes into a word
    assert tensor.shape == (4, 4) and tensor.data_ptr() % 4 == 0


def test_edges_and_middle_read_every_byte(tmp_path):
    data = bytes(random.Random(0).randrange(256) for _ in range(5 * ALIGN + 123))
    path = tmp_path / "weights.bin"
    path.write_bytes(data)
    fd = direct_or_skip(path)
    try:
        for offset, length in [(0, 2 * ALIGN), (100, 50), (ALIGN - 10, 20), (100, 3 * ALIGN), (ALIGN, ALIGN),
                               (3 * ALIGN + 7, 2 * ALIGN + 116), (10, len(data) - 10)]:
            tensor = phased_empty((length,), torch.uint8, offset % ALIGN)
            memory = memoryview(tensor.numpy())
            assert can_read_direct(tensor.data_ptr(), offset)
            start, end = read_edges(fd, memory, offset)
            assert start == end or ((offset + start) % ALIGN == 0 and (end - start) % ALIGN == 0)
            done = start
            while done < end:
                done += os.preadv(fd, [memory[done:end]], offset + done)
            assert bytes(memory) == data[offset:offset + length], (offset, length)
    finally:
        os.close(fd)


@pytest.fixture(scope="module")
def one_layer_mixtral(tmp_path_factory, tiny_tokenizer):
    """A tiny Mixtral of one layer: its experts' tensors lie one after another in the file, every
    one at the same phase."""
    config = tiny_test_config("mixtral", tiny_tokenizer, num_hidden_layers=1)
    path = save_tiny_model(config, tmp_path_factory.mktemp("one-layer-mixtral"), tokenizer=tiny_tokenizer)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def read_every_expert(store: ExpertStore, model, monkeypatch) -> list[int]:
    """Read every expert into two slots laid out at the store's phases, check each against the
    model's, and return the descriptors every read went through."""
    fds, real_read = [], os.preadv

    def read(fd, buffers, offset):
        fds.append(fd)
        return real_read(fd, buffers, offset)

    slots = store.spec.empty(2, phases=store.read_phases)
    monkeypatch.setattr(os, "preadv", read)
    for index, layer in enumerate(find_moe_layers(model)):
        for expert in range(layer.num_experts):
            got = store.read((index, expert), out={name: buffer[expert % 2] for name, buffer in slots.items()})
            for name, param in layer.experts.named_parameters():
                assert torch.equal(got[name], param[expert]), (index, expert, name)
    monkeypatch.undo()
    return fds


def test_slots_at_the_phase_are_read_around_the_page_cache(one_layer_mixtral, monkeypatch):
    path, model = one_layer_mixtral
    os.close(direct_or_skip(path / "model.safetensors"))
    with ExpertStore(path, model, drop_page_cache=True) as store:
        assert store.read_phases.keys() == store.spec.shapes.keys() and store.reads_in_place
        fds = read_every_expert(store, model, monkeypatch)
        assert fds and set(fds) <= set(store._direct.values())  # nothing went through the page cache


def test_pieces_at_another_phase_read_through_the_page_cache(tiny_moe_dir, monkeypatch):
    """Two layers whose experts lie at different phases (a norm's bytes between them): the slots take
    the phase of most bytes, the other layer reads around the page cache through a bounce buffer,
    every expert exact."""
    path = tiny_moe_dir("mixtral")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    os.close(direct_or_skip(path / "model.safetensors"))
    bounced = []
    real_bounced = ExpertStore._read_bounced
    monkeypatch.setattr(ExpertStore, "_read_bounced", lambda self, *args: (bounced.append(args[2]), real_bounced(self, *args)))
    with ExpertStore(path, model, drop_page_cache=True) as store:
        assert store.reads_direct and not store.reads_in_place
        fds = read_every_expert(store, model, monkeypatch)
        assert fds and set(fds) <= set(store._direct.values())
    assert bounced  # some pieces went through the bounce buffer


def test_without_dropping_pages_reads_stay_in_the_page_cache(one_layer_mixtral):
    """Without a memory cap the page cache is a second tier worth keeping: no direct reads."""
    path, model = one_layer_mixtral
    with ExpertStore(path, model) as store:
        assert store.read_phases == {} and not store.reads_direct and not store.reads_in_place


def test_a_plan_whose_reads_pass_around_the_page_cache_books_no_page_cache_for_them(one_layer_mixtral, monkeypatch):
    """Under a cap, with every miss read directly into its slot, the plan keeps no read headroom in
    the page cache and no expert's read in flight: more slots at the same cap, same tokens."""
    path, model = one_layer_mixtral
    os.close(direct_or_skip(path / "model.safetensors"))
    monkeypatch.setattr(loader, "process_footprint", lambda reads=True: FOOTPRINT + (READ_HEADROOM_BYTES if reads else 0))
    monkeypatch.setattr(loader, "file_backed_bytes", lambda: 64 * 2**30)  # no whole-model plan: slots
    with monkeypatch.context() as buffered_only:
        buffered_only.setattr(loader, "opens_direct", lambda paths: False)
        buffered_only.setattr(ExpertStore, "reads_direct", property(lambda self: False))
        buffered_only.setattr(ExpertStore, "reads_in_place", property(lambda self: False))
        with load_offloaded(path, memory=CAP) as probe:
            plan, expert_bytes = probe.runtime.memory_plan, probe.runtime.pool.spec.nbytes
        cap = plan.footprint + plan.reserve + 3 * expert_bytes  # three slots when reads pass through the cache
        buffered = load_offloaded(path, memory=cap)
    direct = load_offloaded(path, memory=cap)
    with direct, buffered:
        assert (buffered.runtime.memory_plan.slots, buffered.runtime.memory_plan.file_pages) == (3, plan.file_pages)
        assert plan.file_pages == CODE_BYTES + READ_HEADROOM_BYTES
        assert direct.runtime.memory_plan.file_pages == CODE_BYTES
        assert direct.runtime.memory_plan.slots == 8  # the headroom and the read in flight buy every expert here
        prompt = torch.tensor([[5, 9, 11, 2]])
        assert torch.equal(direct.generate(prompt, max_new_tokens=8, do_sample=False),
                           buffered.generate(prompt, max_new_tokens=8, do_sample=False))


def test_a_file_system_that_refuses_a_direct_read_is_read_through_the_page_cache(one_layer_mixtral, monkeypatch):
    """Some file systems take `O_DIRECT` at open and refuse the read (EINVAL): that file's reads go
    through the page cache from then on, every expert exact."""
    path, model = one_layer_mixtral
    os.close(direct_or_skip(path / "model.safetensors"))

    def refuse(*args):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(store_module, "read_edges", refuse)
    with ExpertStore(path, model, drop_page_cache=True) as store:
        fds = read_every_expert(store, model, monkeypatch)
        assert fds and not set(fds) & set(store._direct.values())  # every byte through the buffered descriptor
