"""`--memory` holds in a real memory cgroup that counts the page cache: a cap below what the
process needs is refused in seconds naming the smallest cap, and a run at that smallest cap
decodes without re-reading its own pages (major faults per token bounded), with the plain
model's tokens."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from prescient.capped_run import cgroup_kind, run_capped

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(cgroup_kind() == "none", reason="no writable memory cgroup on this machine")]

PROMPT = "def read_config(path):\n"


def _generate(model, memory: str, out=None) -> list[str]:
    return [sys.executable, "-m", "cli.main", "generate", "--model", str(model), "--memory", memory, "--prompt",
            PROMPT, "--max-new-tokens", "24", *(["--json", str(out)] if out else [])]


def test_a_run_at_the_smallest_cap_it_names_does_not_thrash(tiny_moe_dir, tmp_path):
    model = tiny_moe_dir("mixtral")
    start = time.perf_counter()
    refused = subprocess.run(_generate(model, "64MiB"), capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and time.perf_counter() - start < 60
    smallest = re.search(r"smallest memory that works is [\d.]+ GiB \((\d+)MiB\)", refused.stderr)
    assert smallest, refused.stderr[-500:]
    cap = (int(smallest.group(1)) + 8) * 2**20  # just above the refusal
    out = tmp_path / "run.json"
    run = run_capped(_generate(model, f"{cap // 2**20}MiB", out), cap, timeout_s=300)
    assert run.returncode == 0 and not run.killed, run.stderr_tail[-800:]
    record = json.loads(out.read_text())
    assert record["decode_major_faults_per_token"] <= 1.0
    assert len(record["token_ids"]) == 24
