"""Switch Transformers end to end with a SiDA hash function: trace the tiny encoder-decoder,
train the hash function with the Lightning CLI, and serve it through the offloading runtime."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from offload_runtime.engine.loader import load_offloaded
from prescient.loading import load_model, load_tokenizer
from prescient.traces import read_manifest
from training.predictor_cli import main
from training.tracing import trace_model

CONFIG = str(Path(__file__).resolve().parents[2] / "configs/predictor/sida.yaml")
PROMPTS = ["def f(x):\n    return", "The cache keeps the experts that the router will choose next"]


def test_trace_train_and_serve_a_switch_hash_function(tiny_moe_dir, text_corpus, tmp_path, caplog):
    path = tiny_moe_dir("switch_transformers")
    trace = trace_model(path, f"json:{text_corpus}", tmp_path / "trace", split="train", max_tokens=1200,
                        seq_len=24, batch_size=4)
    assert read_manifest(trace).settings["decoder_reads_row_token"] is True
    export = tmp_path / "sida"
    main(["--config", CONFIG, "--data.trace_dir", str(trace), "--trainer.default_root_dir", str(tmp_path / "run"),
          "--trainer.logger", "false", "--trainer.enable_progress_bar", "false", "--trainer.max_epochs", "2",
          "--model.sizes.compress_dim", "16", "--model.sizes.hidden_dim", "32", "--data.window", "12",
          "--data.batch_size", "8", "--export", str(export)])
    meta = json.loads(export.with_suffix(".json").read_text())
    assert meta["kind"] == "sida" and meta["training"]["settings"]["decoder_reads_row_token"] is True

    tokenizer = load_tokenizer(path)
    tokenizer.padding_side = "right"
    inputs = dict(tokenizer(PROMPTS, return_tensors="pt", padding=True))
    settings = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    plain, _ = load_model(path, dtype=torch.float32)
    with torch.inference_mode():
        want = plain.generate(**inputs, **settings)
    model = load_offloaded(path, predictor=export, policy="mrs", budget=0.5)
    with caplog.at_level(logging.WARNING), model.runtime as runtime, torch.inference_mode():
        out = model.generate(**inputs, **settings)
    assert torch.equal(out, want)
    stats = runtime.stats()
    assert stats.forwards == 7  # the encoder once, the decoder per new token
    # each forward acted on its table or ran with predictions paused (the guard: on a tiny model predicting
    # costs more than the loads it saves)
    assert stats.tables_on_time + stats.late_tables + stats.prediction_paused_forwards == stats.forwards
    assert stats.tables_on_time >= 4  # the encoder's and the first decoder forwards, judged after
    assert "one token off" not in caplog.text
