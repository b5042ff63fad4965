"""Writes that fail part-way, as on a full disk (simulated by a file-size limit, see `commands.prescient`),
through the real `prescient` command: exit 2 and one `error:` line naming the path and the cause, no
traceback, nothing half-written where the finished output belongs, and the same command succeeds once
there is room."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.commands import ROOT, error_line, prescient
from tests.test_reference_model import MICRO
from training.tracing import trace_model

LIMIT = 16 * 1024  # bytes per file: room for configs, manifests and tokenizers, not for weights or shards


@pytest.mark.slow  # 20-45 s: the default suite must stay under 10 minutes on 2 cores
def test_quantize_on_a_full_disk_leaves_nothing_and_a_rerun_succeeds(tiny_moe_dir, tmp_path):
    model, out = tiny_moe_dir("mixtral"), tmp_path / "int4"
    args = ("quantize", "--model", model, "--bits", "4", "--out", out)
    done = prescient(*args, file_limit=LIMIT)
    assert done.returncode == 2
    assert error_line(done.stderr).startswith(f"error: cannot write {out}: File too large; free space")
    assert list(tmp_path.iterdir()) == []  # neither the output nor its hidden build folder
    assert prescient(*args).returncode == 0
    assert json.loads((out / "quantize.json").read_text())["bits"] == 4


@pytest.mark.slow  # 20-45 s: the default suite must stay under 10 minutes on 2 cores
def test_trace_on_a_full_disk_stays_resumable_and_a_rerun_completes_it(tiny_moe_dir, text_corpus, tmp_path):
    out = tmp_path / "trace"
    args = ("trace", "--model", tiny_moe_dir("mixtral"), "--dataset", f"json:{text_corpus}", "--split", "train",
            "--max-tokens", "2000", "--seq-len", "16", "--out", out)
    done = prescient(*args, file_limit=LIMIT)
    assert done.returncode == 2
    assert error_line(done.stderr).startswith(f"error: cannot write {out / 'shard-00000.safetensors'}: File too large")
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json"]  # no torn shard, no temporary
    assert json.loads((out / "manifest.json").read_text())["complete"] is False
    assert prescient(*args).returncode == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] is True and manifest["shards"]


@pytest.mark.slow  # ~45 s on 2 busy cores; its writes fail through the same `write_errors` as quantize's
def test_reference_model_on_a_full_disk_writes_no_model(tmp_path):
    recipe, out = tmp_path / "micro.yaml", tmp_path / "micro"
    recipe.write_text(yaml.safe_dump(MICRO))
    done = prescient("reference-model", "--recipe", recipe, "--out", out, file_limit=LIMIT)  # checkpoints exceed it
    assert done.returncode == 2
    assert error_line(done.stderr).startswith(f"error: cannot write {out}: File too large")
    assert sorted(p.name for p in out.iterdir()) == [".train"]  # no model file, no reference.json
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp") or p.name == ".saving"]


@pytest.mark.slow  # a trace, then Lightning in a child process: ~45 s on 2 busy cores
def test_train_on_a_full_disk_is_one_line(tiny_moe_dir, text_corpus, tmp_path):
    """Lightning writes its checkpoints itself: `cli.main` still ends a lack of room in one line."""
    trace = trace_model(tiny_moe_dir("mixtral"), f"json:{text_corpus}", tmp_path / "trace", split="train",
                        max_tokens=60, seq_len=16)
    done = prescient("train", "--config", ROOT / "configs/predictor/sida.yaml", "--data.trace_dir", trace,
                     "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
                     "--trainer.default_root_dir", tmp_path / "run", "--model.sizes.compress_dim", "8",
                     "--model.sizes.hidden_dim", "16", "--export", tmp_path / "sida", file_limit=4096)
    assert done.returncode == 2
    assert error_line(done.stderr).startswith("error: cannot write an output file: File too large")
    assert not list(tmp_path.glob("sida*"))
