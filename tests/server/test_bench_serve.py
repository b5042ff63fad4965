"""`bench-serve`'s load test end to end on a tiny model: the official `openai` client, with the key the
bench gives its server process, gets every streamed completion answered; the server exits 0."""

from __future__ import annotations

import json

import pytest

from experiments.bench_serve import bench_serve


@pytest.mark.slow  # a server process and three levels: ~50 s on 2 busy cores
def test_bench_serve_answers_every_request_through_the_openai_client(tiny_moe_dir, text_corpus, tmp_path):
    out = tmp_path / "bench.json"
    result = bench_serve(str(tiny_moe_dir("mixtral")), str(out), clients=(1, 3), rounds=1, max_requests=3,
                         max_tokens=4, prompt_tokens=(4, 8), repeats=1, level_time_s=120, request_timeout_s=120,
                         dataset=f"json:{text_corpus}", split="train")
    assert [(run["clients"], run["answered"], run["lost"]) for run in result["runs"]] == [(1, 1, 0), (3, 3, 0)]
    assert all(run["runtime"]["completion_tokens_total"] == 4 * run["answered"] for run in result["runs"])
    assert result["server_exit_status"] == [0]
    assert json.loads(out.read_text())["summary"]["none"]["3"]["lost"] == 0
