"""A signal ends a long command with 128 + its number (SIGINT 130, SIGTERM 143, as shells and Lightning
do) and one `error:` line, after leaving what it wrote resumable: sent to a real `prescient` process
mid-work. (`prescient serve` stops gracefully on either and exits 0: tests/server/test_lifecycle.py.)"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml

from tests.commands import error_line, prescient
from tests.test_reference_model import MICRO


def signal_when(proc, ready: Callable[[], bool], sig: signal.Signals, seconds: float = 300) -> tuple[int, str]:
    """Send `sig` to `proc` once `ready()`; its exit status and stderr."""
    deadline = time.monotonic() + seconds
    while not ready():
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "the command never got there"
        time.sleep(0.02)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=120)
    return proc.returncode, stderr


def listed_shards(trace: Path) -> int:
    try:
        return len(json.loads((trace / "manifest.json").read_text())["shards"])
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


@pytest.mark.slow  # ~90 s on 2 busy cores: the rerun traces the rest
def test_sigint_mid_trace_exits_130_and_a_rerun_completes_it(tiny_moe_dir, text_corpus, tmp_path):
    out = tmp_path / "trace"
    args = ("trace", "--model", tiny_moe_dir("mixtral"), "--dataset", f"json:{text_corpus}", "--split", "train",
            "--max-tokens", "2000", "--seq-len", "4", "--batch-size", "4", "--out", out)  # 1020 tokens a shard
    status, stderr = signal_when(prescient(*args, wait=False), lambda: listed_shards(out) >= 1, signal.SIGINT)
    assert status == 130
    assert error_line(stderr).startswith("error: stopped by SIGINT; nothing is left half-written")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] is False
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", *(s["file"] for s in manifest["shards"])]
    assert prescient(*args).returncode == 0
    resumed = json.loads((out / "manifest.json").read_text())
    assert resumed["complete"] is True and resumed["shards"][:len(manifest["shards"])] == manifest["shards"]


@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, 143),
                                         pytest.param(signal.SIGINT, 130, marks=pytest.mark.slow)],  # one handler
                         ids=["SIGTERM", "SIGINT"])
def test_a_signal_mid_training_exits_128_plus_it_with_a_checkpoint_to_resume(tmp_path, sig, status):
    recipe, out = tmp_path / "micro.yaml", tmp_path / "micro"
    recipe.write_text(yaml.safe_dump({**MICRO, "training": {**MICRO["training"], "max_steps": 500}}))
    checkpoint = out / ".train" / "last.ckpt"  # written every 5 steps, and on the way out
    proc = prescient("reference-model", "--recipe", recipe, "--out", out, wait=False)
    ended, stderr = signal_when(proc, checkpoint.exists, sig)
    assert ended == status
    assert error_line(stderr).startswith(f"error: stopped by {sig.name}")
    assert sorted(p.name for p in out.iterdir()) == [".train"]  # no model, no reference.json
    assert torch.load(checkpoint, weights_only=False)["global_step"] >= 5
