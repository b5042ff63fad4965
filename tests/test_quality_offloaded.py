"""`prescient quality --budget`: both models run through the offloading runtime, neither whole in
memory, under a budget that forces misses; the figures are those of the whole models."""

from __future__ import annotations

from experiments.quality import measure_quality
from offload_runtime.engine.options import RuntimeOptions

ARGS = dict(split="train", seq_len=16, windows=3, batch_size=2)


def test_quality_through_the_runtime_equals_the_whole_models(tiny_moe_dir, text_corpus):
    model, datasets = tiny_moe_dir("mixtral"), (f"json:{text_corpus}",)
    whole = measure_quality(model, model, datasets, **ARGS)
    offloaded = measure_quality(model, model, datasets, options=RuntimeOptions(budget="3slots"), offload=True, **ARGS)
    assert offloaded["options"]["budget"] is not None and whole["options"] is None
    assert offloaded["datasets"] == whole["datasets"] and offloaded["fingerprint_match"]
    figures = offloaded["datasets"][datasets[0]]
    assert figures["kl_nats"] == 0 and figures["top1_agreement"] == 1
