"""`prescient quality --budget`: both models run through the offloading runtime, neither whole in
memory, under a budget that forces misses; the figures are those of the whole models."""

from __future__ import annotations

import json

import experiments.quality as quality
from cli.main import main
from experiments.quality import measure_quality
from offload_runtime.engine import loader
from offload_runtime.engine import store as store_module
from offload_runtime.engine.loader import load_offloaded
from offload_runtime.engine.memory_plan import MiB, reserve_bytes
from offload_runtime.engine.options import RuntimeOptions
from prescient.model_dir import ModelDirectory

FOOTPRINT = 400 * MiB  # a fixed process footprint, so that slot counts do not depend on this process

ARGS = dict(split="train", seq_len=16, windows=3, batch_size=2)


def test_quality_through_the_runtime_equals_the_whole_models(tiny_moe_dir, text_corpus):
    model, datasets = tiny_moe_dir("mixtral"), (f"json:{text_corpus}",)
    whole = measure_quality(model, model, datasets, **ARGS)
    offloaded = measure_quality(model, model, datasets, options=RuntimeOptions(budget="3slots"), offload=True, **ARGS)
    assert offloaded["options"]["budget"] is not None and whole["options"] is None
    assert offloaded["datasets"] == whole["datasets"] and offloaded["fingerprint_match"]
    figures = offloaded["datasets"][datasets[0]]
    assert figures["kl_nats"] == 0 and figures["top1_agreement"] == 1



def test_quality_command_under_a_memory_cap_runs_both_models_offloaded_and_equals_the_whole_models(
        tiny_moe_dir, text_corpus, tmp_path, monkeypatch):
    """`prescient quality --memory`: the reference is planned for half the cap, the model for what
    the process has left once the reference is in it; each buys 4 of 16 experts' slots (misses),
    and the figures are still the whole models'."""
    model, dataset = tiny_moe_dir("mixtral"), f"json:{text_corpus}"
    whole = measure_quality(model, model, (dataset,), split="train", seq_len=16, windows=3)  # the command's batch
    probe = load_offloaded(model, None, budget=1.0)
    expert_bytes = probe.runtime.pool.spec.nbytes
    probe.runtime.close()
    reserve = reserve_bytes(ModelDirectory.open(model).config, 4, expert_bytes)  # one transfer worker
    # a fixed process, which grows by what the reference's plan holds once it is loaded
    held = [FOOTPRINT]
    monkeypatch.setattr(loader, "process_footprint", lambda reads=True: held[0])
    monkeypatch.setattr(store_module, "open_direct", lambda path: None)  # reads through the page cache, as
    monkeypatch.setattr(loader, "opens_direct", lambda paths: False)  # `reserve` above books them
    monkeypatch.setattr(quality, "process_footprint", lambda: held[0])
    real_loaded = quality._loaded

    def loaded_and_held(*args):
        loaded, fingerprint = real_loaded(*args)
        plan = loaded.runtime.memory_plan
        held[0] += plan.reserve + plan.slots * plan.expert_bytes
        return loaded, fingerprint

    monkeypatch.setattr(quality, "_loaded", loaded_and_held)
    cap = FOOTPRINT + 2 * (reserve + 4 * expert_bytes) + expert_bytes // 2
    out = tmp_path / "quality.json"
    main(["quality", "--model", str(model), "--reference", str(model), "--dataset", dataset, "--split", "train",
          "--seq-len", "16", "--windows", "3", "--memory", f"{cap}B", "--json", str(out)])
    offloaded = json.loads(out.read_text())
    assert offloaded["options"]["memory"] == cap
    assert all("4 of 16 experts in slots" in line for line in offloaded["memory_plans"].values())
    assert offloaded["datasets"] == whole["datasets"] and offloaded["fingerprint_match"]
