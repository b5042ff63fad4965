"""Trace, train a SiDA hash function and serve it on architectures beyond the first eight: Llama 4
(experts called without ids) and Gemma 4 (router inside the decoder layer); generation with the
predictor prefetching equals the plain model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from experiments.arch_support import greedy, prompt_inputs
from offload_runtime.engine.loader import load_offloaded
from prescient.arch_zoo import moe_families, save_tiny_model
from prescient.loading import load_model
from training.predictor_cli import main
from training.tracing import trace_model

CONFIG = str(Path(__file__).resolve().parents[2] / "configs/predictor/sida.yaml")


@pytest.mark.parametrize("model_type", ["llama4_text", "gemma4_text"])
def test_trace_train_and_serve_a_hash_function(model_type, tiny_tokenizer, text_corpus, tmp_path):
    path = save_tiny_model(next(f for f in moe_families() if f.model_type == model_type), tmp_path / "model")
    tiny_tokenizer.save_pretrained(path)
    trace = trace_model(path, f"json:{text_corpus}", tmp_path / "trace", split="train", max_tokens=600,
                        seq_len=24, batch_size=4)
    export = tmp_path / "sida"
    main(["--config", CONFIG, "--data.trace_dir", str(trace), "--trainer.default_root_dir", str(tmp_path / "run"),
          "--trainer.logger", "false", "--trainer.enable_progress_bar", "false", "--trainer.max_epochs", "1",
          "--model.sizes.compress_dim", "16", "--model.sizes.hidden_dim", "32", "--data.window", "12",
          "--data.batch_size", "8", "--export", str(export)])
    meta = json.loads(export.with_suffix(".json").read_text())
    assert meta["kind"] == "sida" and meta["fingerprint"]["arch"] == model_type

    inputs = prompt_inputs(encoder_decoder=False)
    plain, _ = load_model(path, dtype=torch.float32)
    model = load_offloaded(path, predictor=export, policy="mrs", budget=0.5)
    with model.runtime as runtime:
        assert torch.equal(greedy(model, inputs), greedy(plain, inputs))
    stats = runtime.stats()
    assert stats.tables_on_time + stats.late_tables == stats.forwards == 4
