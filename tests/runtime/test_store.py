"""ExpertStore against real tiny checkpoints of every supported architecture."""

from __future__ import annotations

import mmap
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers.core_model_loading import Interleave, Transpose, WeightConverter

from offload_runtime.engine import store as store_module
from offload_runtime.engine.store import ExpertStore, StoreError
from prescient.arch import MoELayer, find_moe_layers
from prescient.errors import ModelFilesError


def expert_tensors(layer: MoELayer, expert: int) -> dict[str, torch.Tensor]:
    """What the loaded model computes with for one expert."""
    if layer.adapter.name == "switch":
        return dict(list(layer.experts.children())[expert].named_parameters())
    return {name: param[expert] for name, param in layer.experts.named_parameters()}


def assert_store_matches(store: ExpertStore, layers: list[MoELayer]) -> None:
    for index, layer in enumerate(layers):
        for expert in range(layer.num_experts):
            got, want = store.read((index, expert)), expert_tensors(layer, expert)
            assert got.keys() == want.keys()
            for name in want:
                assert torch.equal(got[name], want[name]), (index, expert, name)


def test_store_equals_model_slices(tiny_moe):
    model = tiny_moe.load()
    layers = find_moe_layers(model)
    with ExpertStore(tiny_moe.path, model) as store:
        assert store.num_layers == len(layers) and store.num_experts == layers[0].num_experts
        assert_store_matches(store, layers)
        one = sum(t.numel() * t.element_size() for t in expert_tensors(layers[0], 0).values())
        assert store.expert_nbytes == one
        assert store.total_nbytes == one * len(layers) * layers[0].num_experts


def load_mixtral(path: Path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def mixtral(tiny_moe_dir):
    path = tiny_moe_dir("mixtral")
    return path, load_mixtral(path)


def test_host_mode_reads_once_and_serves_from_memory(mixtral, tmp_path):
    path, model = mixtral
    copy = shutil.copytree(path, tmp_path / "model")
    store = ExpertStore(copy, model, mode="host")
    for file in copy.glob("*.safetensors"):
        file.write_bytes(b"")  # the host copy no longer needs the files
    assert_store_matches(store, find_moe_layers(model))
    resident = store.resident((1, 3))
    assert torch.equal(resident["down_proj"], find_moe_layers(model)[1].experts.down_proj[3])
    store.close()


def test_drop_page_cache_drops_every_page_it_reads_and_reads_correct_data(mixtral, monkeypatch):
    path, model = mixtral
    calls = []  # ("read" | advice, fd, offset, length) in order
    real_advise, real_read = os.posix_fadvise, os.preadv

    def advise(fd: int, offset: int, length: int, advice: int) -> None:
        calls.append((advice, fd, offset, length))
        real_advise(fd, offset, length, advice)

    def read(fd: int, buffers, offset: int) -> int:
        got = real_read(fd, buffers, offset)
        calls.append(("read", fd, offset, got))
        return got

    monkeypatch.setattr(os, "posix_fadvise", advise)
    monkeypatch.setattr(os, "preadv", read)
    monkeypatch.setattr(store_module, "open_direct", lambda path: None)  # the buffered path (direct: test_direct_read)
    with ExpertStore(path, model, drop_page_cache=True) as store:
        assert_store_matches(store, find_moe_layers(model))
    assert calls[0][0] == os.POSIX_FADV_RANDOM and calls[0][2:] == (0, 0)  # read-ahead off: one file
    reads = [i for i, call in enumerate(calls) if call[0] == "read"]
    assert len(reads) >= store.num_layers * store.num_experts
    first = reads[0]
    assert calls[first - 1] == (os.POSIX_FADV_DONTNEED, calls[first][1], 0, 0)  # the whole file, once, first
    assert sum(call[0] == os.POSIX_FADV_DONTNEED and call[2:] == (0, 0) for call in calls) == 1
    for i in reads:  # then each read's own pages, right after it
        _, fd, offset, length = calls[i]
        advice, dropped_fd, start, span = calls[i + 1]
        assert (advice, dropped_fd) == (os.POSIX_FADV_DONTNEED, fd)
        assert start % mmap.PAGESIZE == 0 and (start + span) % mmap.PAGESIZE == 0
        assert start <= offset and offset + length <= start + span < offset + length + mmap.PAGESIZE


def rewrite(path: Path, tmp_path: Path, change) -> Path:
    """A copy of model dir `path` whose single weight file went through `change(state_dict)`."""
    copy = shutil.copytree(path, tmp_path / "changed")
    file = copy / "model.safetensors"
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})
    return copy


def test_wrong_shape_names_layer_and_expert(mixtral, tmp_path):
    path, model = mixtral
    key = "model.layers.1.block_sparse_moe.experts.2.w1.weight"
    changed = rewrite(path, tmp_path, lambda t: t.__setitem__(key, t[key][:-1].clone()))
    with pytest.raises(StoreError, match=r"layer 1 expert 2: .*experts\.2\.w1\.weight.* shape"):
        ExpertStore(changed, model)


def test_wrong_dtype_names_layer_and_expert(mixtral, tmp_path):
    path, model = mixtral
    key = "model.layers.0.block_sparse_moe.experts.5.w2.weight"
    changed = rewrite(path, tmp_path, lambda t: t.__setitem__(key, t[key].half()))
    with pytest.raises(StoreError, match=r"layer 0 expert 5: .*torch\.float16"):
        ExpertStore(changed, model)


def test_corrupt_or_truncated_file_is_named(mixtral, tmp_path):
    path, model = mixtral
    copy = shutil.copytree(path, tmp_path / "model")
    file = copy / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[:100])
    with pytest.raises(ModelFilesError, match="model.safetensors"):
        ExpertStore(copy, model)
    file.write_bytes(data)
    store = ExpertStore(copy, model)
    os.truncate(file, len(data) // 2)  # shrinks under an open store
    with pytest.raises(StoreError, match=r"model\.safetensors .*truncated"):
        for key in [(layer, expert) for layer in range(store.num_layers) for expert in range(store.num_experts)]:
            store.read(key)
    store.close()


def test_layout_follows_transformers_conversions(mixtral, tmp_path):
    """A checkpoint whose gate/up rows are interleaved and whose down_proj is transposed (as some
    architectures store them) is derived from the conversion ops alone."""
    path, _ = mixtral
    model = load_mixtral(path)
    model._weight_conversions = [
        WeightConverter("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj", operations=[Interleave(dim=1)]),
        WeightConverter("mlp.experts.down_proj", "mlp.experts.down_proj", operations=[Transpose(1, 2)]),
    ]
    model.save_pretrained(tmp_path / "odd")
    stored = load_file(tmp_path / "odd" / "model.safetensors")
    experts = find_moe_layers(model)[0].experts
    assert torch.equal(stored["model.layers.0.mlp.experts.down_proj"], experts.down_proj.transpose(1, 2))
    with ExpertStore(tmp_path / "odd", model) as store:
        assert_store_matches(store, find_moe_layers(model))


def test_unknown_mode_and_key(mixtral):
    path, model = mixtral
    with pytest.raises(StoreError, match="mode"):
        ExpertStore(path, model, mode="ssd")
    with ExpertStore(path, model) as store, pytest.raises(StoreError, match="no expert"):
        store.read((store.num_layers, 0))


def test_sharded_checkpoint_and_missing_shard(mixtral, tmp_path):
    path, model = mixtral
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    shards = sorted((tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) > 2
    with ExpertStore(tmp_path / "sharded", model) as store:
        assert_store_matches(store, find_moe_layers(model))
    shards[1].unlink()
    with pytest.raises(ModelFilesError, match=shards[1].name):  # opening the directory finds it missing
        ExpertStore(tmp_path / "sharded", model)


@pytest.mark.parametrize("drop_page_cache", [False, True])
def test_reads_split_into_parallel_reads_fill_the_same_bytes(mixtral, monkeypatch, drop_page_cache):
    """`read_depth`: each read in chunks read at once (256-byte chunks here, so that the tiny
    experts' tensors split), the same tensors as one read."""
    path, model = mixtral
    monkeypatch.setattr(store_module, "MIN_CHUNK", 256)
    monkeypatch.setattr(store_module, "CHUNK_ALIGN", 256)
    monkeypatch.setattr(store_module, "open_direct", lambda path: None)  # chunks of direct reads: test_direct_read
    chunks = []
    read_fully = store_module._read_fully
    monkeypatch.setattr(store_module, "_read_fully", lambda *args: (chunks.append(len(args[2])), read_fully(*args)))
    layers = find_moe_layers(model)
    with ExpertStore(path, model, read_depth=4, drop_page_cache=drop_page_cache) as store:
        assert_store_matches(store, layers)
    reads = sum(layer.num_experts for layer in layers) * len(store.spec.shapes)
    assert len(chunks) >= 4 * reads and max(chunks) <= store.expert_nbytes // 4  # every read split in 4 or more
    with pytest.raises(StoreError, match="closed"):
        store.read((0, 0))
