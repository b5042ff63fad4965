"""scripts/gpu-check, the first GPU's one script: its dry run exercises everything but CUDA (the
cuda tests collected, the bench and the copy timing on the CPU) and writes the one JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import random_sida

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu-check"


@pytest.mark.slow  # ~30 s on two cores: the default suite stays under 10 minutes
def test_the_dry_run_writes_every_part_of_the_record(tiny_moe_dir, tmp_path):
    model = tiny_moe_dir("mixtral")
    predictor = random_sida(model, tmp_path, horizon=2)
    out = tmp_path / "results" / "gpu-check.json"
    done = subprocess.run([sys.executable, str(SCRIPT), str(out), "--dry-run", "--model", str(model),
                           "--predictor", str(predictor), "--tokens", "4", "--repeats", "1", "--dtype", "float32",
                           "--tests", "tests/runtime/test_transfer.py"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["dry_run"] and record["device"] == "cpu"
    assert record["cuda_tests"]["exit"] == 0 and "test_cuda_copies_on_a_side_stream" in record["cuda_tests"]["tail"]
    assert record["pinned_bytes_per_s"] > 0
    bench = record["bench"]
    assert [r["hybrid"] for r in bench["runs"]] == [True, False]  # interleaved
    assert bench["same_tokens"] and bench["speedup"] > 0
    assert all(len(r["token_ids"]) == 4 for r in bench["runs"])
    assert bench["runs"][1]["copied_bytes"] > 0 and record["decode_h2d"]["bytes_per_s_while_copying"] > 0
    assert set(record["targets"]) == {"cuda_tests_pass", "hybrid_at_least_1.5x", "h2d_at_least_80%"}


def test_without_cuda_and_without_dry_run_it_says_what_to_do(tmp_path):
    import torch

    if torch.cuda.is_available():
        return
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "x.json")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "--dry-run" in done.stderr
